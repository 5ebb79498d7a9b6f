"""The CPU compose topology (profile `cpu`: migrate, gateway, worker-cpu) with LoRA on
(CONVEYOR_ENABLE_LORA in .env), an adapter in the ``/adapters`` mount registered through
the admin API and served by chat, with the `openai` client.

Its own topology because the vision one (test_topology.py) serves the demo LLaVA, and
Conveyor serves adapters for text models only (workers/engines/vllm/lora.py); here the
worker serves the text demo model the image bakes. tests/deploy/topology.py says what is
swapped for a container's: the ``/adapters`` mount is a local folder, so the path
registered is that folder's (in containers: ``/adapters/my-lora``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import openai
import pytest

from tests.deploy.topology import Topology, redis_url, run_topology
from tests.e2e.stack import CONVEYOR

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

ADMIN_KEY = "compose-lora-admin-secret"
DOT_ENV = {  # what an operator puts in .env for this topology
    "CONVEYOR_REDIS_URL": redis_url(12),
    "CONVEYOR_ADMIN_KEY": ADMIN_KEY,
    "CONVEYOR_DTYPE": "float32",
    "CONVEYOR_ENABLE_LORA": "true",
}
BASE = "conveyor-demo"
ADAPTER = "my-lora"


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    with run_topology(DOT_ENV, ("worker-cpu",), tmp_path_factory) as topology:
        yield topology


def test_an_adapter_from_the_adapters_mount_serves_chat(topology: Topology) -> None:
    folder = topology.adapters_dir / ADAPTER
    base = topology.data_dir / "demo-model"  # the image's demo model (Dockerfile RUN line)
    subprocess.run(
        [CONVEYOR, "demo-model", str(folder), "--kind", "lora", "--base", str(base)],
        check=True,
        capture_output=True,
    )
    body = {"name": ADAPTER, "path": str(folder), "base_model": BASE}
    added = topology.admin("POST", "/admin/loras", body)
    assert added.status_code == 200, added.text
    cards = {model.id: model for model in topology.client().models.list().data}
    assert (cards[ADAPTER].model_extra or {})["parent"] == BASE
    assert (cards[BASE].model_extra or {})["parent"] is None
    client = topology.client()
    outputs = {}
    for model in (ADAPTER, BASE):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.model == model
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        outputs[model] = reply.choices[0].message.content
    assert outputs[ADAPTER] != outputs[BASE]  # the random adapter changes greedy output


def test_the_adapter_streams_and_unregisters(topology: Topology) -> None:
    client = topology.client()
    chunks = client.chat.completions.create(
        model=ADAPTER,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens == 8
    removed = topology.admin("DELETE", f"/admin/loras/{ADAPTER}")
    assert removed.status_code == 200, removed.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "Hello"}], max_tokens=2
        )
