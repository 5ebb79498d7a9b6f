"""SGLang's P/D bootstrap handoff: ``{bootstrap_host, bootstrap_port, bootstrap_room}``.

The prefill engine runs a bootstrap server (``--disaggregation-bootstrap-port``); a
request pair is joined by a *bootstrap room*, a random 63-bit integer the caller
picks, so the handoff is known before prefill starts. The prefill worker plans it
(:func:`plan_handoff`), queues the decode job with it, and runs the prompt into that
room; the decode engine registers with the prefill engine for the room and receives
the KV cache plus the first sampled token. Without a handoff, a prefill or decode
engine runs SGLang's *fake transfer* (:func:`fake_transfer`), which is only good as a
liveness probe (the worker canary).
"""

from __future__ import annotations

import secrets
from typing import Any, Final

from shared.errors import EngineError
from shared.roles import Role
from workers.engines.base import Handoff

DEFAULT_BOOTSTRAP_PORT: Final = 8998
"""SGLang's default ``disaggregation_bootstrap_port``."""

FAKE_BOOTSTRAP_HOST: Final = "2.2.2.2"
"""``sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST``: a request carrying it uses the
fake KV transfer (no peer engine needed)."""

BOOTSTRAP_ROOM_BITS: Final = 63
"""Rooms are random 63-bit integers (SGLang's mini_lb and Dynamo both use
``random.randint(0, 2**63 - 1)``)."""

HANDOFF_KEYS: Final = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def plan_handoff(host: str, port: int) -> Handoff:
    """A new room on this prefill engine's bootstrap server."""
    return {
        "bootstrap_host": host,
        "bootstrap_port": port,
        "bootstrap_room": secrets.randbits(BOOTSTRAP_ROOM_BITS),
    }


def bootstrap_fields(handoff: Handoff) -> dict[str, Any]:
    """A handoff's bootstrap fields for ``async_generate``; ``EngineError`` when malformed."""
    try:
        host, port, room = (handoff[key] for key in HANDOFF_KEYS)
    except (KeyError, TypeError) as exc:
        raise EngineError(f"malformed SGLang handoff {handoff!r}") from exc
    if (
        not isinstance(host, str)
        or not isinstance(port, int)
        or not isinstance(room, int)
        or isinstance(port, bool)
        or isinstance(room, bool)
    ):
        raise EngineError(f"malformed SGLang handoff {handoff!r}")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def fake_transfer(port: int) -> dict[str, Any]:
    """Dynamo's ``SglangDisaggHealthCheckPayload``: fake transfer, room 0, own bootstrap port."""
    return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": port, "bootstrap_room": 0}


def generate_fields(role: Role, handoff: Handoff | None, port: int) -> dict[str, Any]:
    """The bootstrap fields of a ``generate`` on an engine in ``role``.

    A handoff is for decode engines only; without one, an aggregated engine needs none
    and a prefill or decode engine runs the fake transfer on its own ``port``.
    """
    if handoff is not None:
        if role is not Role.DECODE:
            raise EngineError(f"an SGLang engine in role {role.value!r} got a KV handoff")
        return bootstrap_fields(handoff)
    if role in (Role.PREFILL, Role.DECODE):
        return fake_transfer(port)
    return {}
