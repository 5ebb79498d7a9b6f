"""vLLM's NixlConnector without NIXL's busy-polling UCX progress thread (CPU engines).

vLLM imports this module (``kv_connector_module_path``, see ``vllm_engine``) in every
process that builds the connector, the model-worker process that owns the NIXL agent
included, and takes ``NixlConnector`` from here: the very class vLLM registers under
that name, so everything vLLM decides by connector name stays the same.

Why: nixl's Python API hard-wires the progress thread's poll timeout to zero
(``agent_config.pthrDelay = 0`` in ``nixl/_api.py``), so its UCX thread
(``nixlUcxSharedThread::run``: progress, ``ucp_worker_arm``, ``poll(fds, 0)``) spins a
whole core per engine forever, idle or not: 2 cores of this 2-core box, 0 voluntary
context switches. Without the thread, NIXL progresses UCX when the connector asks for
notifications or transfer states, which vLLM does on every engine step, and an engine
keeps stepping while a transfer is pending on its side (decode: a request waits for its
remote KV; prefill: a finished request holds its blocks until decode has read them).
``NIXL_THREAD_SYNC_RW`` keeps UCX workers thread-safe (the mode the progress thread
implied) for vLLM's handshake thread, which adds remote agents beside the engine step.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPullConnector,
    NixlPushConnector,
)

__all__ = ["NixlConnector", "NixlPullConnector", "NixlPushConnector"]


def _without_progress_thread(make_config: Any) -> Any:
    sync = importlib.import_module(make_config.__module__).nixl_thread_sync_t

    def agent_config(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        kwargs.setdefault("sync_mode", sync.NIXL_THREAD_SYNC_RW)
        return make_config(*args, **kwargs)

    agent_config.conveyor_patched = True  # type: ignore[attr-defined]
    return agent_config


_config = getattr(base_worker, "nixl_agent_config", None)  # None: no nixl package
if _config is not None and not getattr(_config, "conveyor_patched", False):
    setattr(base_worker, "nixl_agent_config", _without_progress_thread(_config))  # noqa: B010
