"""The CPU compose topology with the vision demo and the embedding model
(tests/deploy/topology.py says what is swapped for a container's): services migrate,
gateway, worker-cpu, encode-cpu, embed-cpu, with .env turning on auth, the vision demo,
the embedding model and LoRA, driven with the `openai` client.

LoRA is on here as an operator would set it, but the vision demo model (a tiny LLaVA)
serves no adapters (workers/engines/vllm/lora.py: text models only), so registering one
for it is refused with a clean 400; tests/deploy/test_topology_lora.py runs the text
topology (profile `cpu`) where an adapter from the ``/adapters`` mount serves chat.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.deploy.topology import Topology, redis_url, run_topology

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

ADMIN_KEY = "compose-topology-admin-secret"
DOT_ENV = {  # what an operator puts in .env for this topology
    "CONVEYOR_REDIS_URL": redis_url(11),
    "CONVEYOR_ADMIN_KEY": ADMIN_KEY,
    "CONVEYOR_ENCODE": "true",  # the vision demo (a tiny LLaVA) everywhere
    "CONVEYOR_EMBED_MODEL": "default",
    "CONVEYOR_DTYPE": "float32",
    "CONVEYOR_ENABLE_LORA": "true",
}
WORKERS = ("embed-cpu", "worker-cpu", "encode-cpu")


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    with run_topology(DOT_ENV, WORKERS, tmp_path_factory) as topology:
        _wait_for_encode_pool(topology)
        yield topology


def _wait_for_encode_pool(topology: Topology) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for process in topology.processes.values():
            assert process.popen.poll() is None, f"{process.name}:\n{process.log_tail()}"
        pools = topology.admin("GET", "/admin/state").json()["pools"]
        if pools.get("conveyor-demo", {}).get("encode"):
            return
        time.sleep(0.5)
    raise TimeoutError("the encode worker never joined")


def test_ready_lists_the_chat_and_embedding_models(topology: Topology) -> None:
    body = topology.admin("GET", "/ready").json()  # the details are an admin's
    assert body["ready"] is True
    assert set(body["models"]) == {"conveyor-demo", "all-MiniLM-L6-v2"}
    assert httpx.get(f"{topology.base_url}/ready", timeout=10).json() == {
        "ready": True,
        "problems": [],
    }


def test_auth_is_on_and_an_admin_made_key_serves_chat(topology: Topology) -> None:
    with pytest.raises(openai.AuthenticationError):
        topology.client(key="wrong").models.list()
    created = topology.admin("POST", "/admin/keys", {"name": "compose"})
    assert created.status_code == 201, created.text
    client = topology.client(key=created.json()["key"])
    _wait_until_known(client)
    reply = client.chat.completions.create(
        model="conveyor-demo",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    chunks = client.chat.completions.create(
        model="conveyor-demo",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens == 8


def _wait_until_known(client: openai.OpenAI) -> None:
    """Gateways learn a new key from SQL when the Redis generation moves (polled every
    250 ms, gateway/control/key_cache.py): not at once on a loaded machine."""
    deadline = time.monotonic() + 15
    while True:
        try:
            client.models.list()
            return
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_embeddings_come_from_the_embed_worker(topology: Topology) -> None:
    result = topology.client().embeddings.create(model="all-MiniLM-L6-v2", input=["a", "b"])
    assert [len(item.embedding) for item in result.data] == [384, 384]


def test_an_image_goes_through_the_encode_worker(topology: Topology) -> None:
    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(picture, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    reply = topology.client().chat.completions.create(
        model="conveyor-demo",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert "image(s) encoded" in topology.processes["encode-cpu"].log_path.read_text()


def test_a_lora_adapter_for_the_vision_demo_is_refused_with_the_reason(
    topology: Topology,
) -> None:
    """LoRA is on, but the worker's base is the LLaVA demo: the adapter (made for it, in the
    ``/adapters`` mount) is refused by every worker, nothing stays registered, chat still
    works. The text topology (test_topology_lora.py) serves one."""
    from shared.demo.lora import write_demo_lora

    folder = write_demo_lora(
        topology.adapters_dir / "llava-lora", base=topology.data_dir / "demo-model-llava"
    )
    body = {"name": "llava-lora", "path": str(folder), "base_model": "conveyor-demo"}
    refused = topology.admin("POST", "/admin/loras", body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_load_failed"
    assert "text models only" in error["message"], error
    assert topology.admin("GET", "/admin/loras").json()["data"] == []
    models = {model.id for model in topology.client().models.list().data}
    assert "llava-lora" not in models
