"""The address other hosts reach this worker at: one rule for every engine.

A prefill engine tells decode engines where to fetch its KV cache from (vLLM: the
NIXL side channel, ``kv_side_channel_host``; SGLang: the bootstrap server,
``sglang_bootstrap_host``). Each engine keeps its own setting; both resolve it here:

1. a configured address (anything but :data:`AUTO`) is used as it is;
2. else the address the engine binds to, when that is one specific address;
3. else :func:`this_host_address`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Final

AUTO: Final = "auto"
"""A host setting's value for "work out this host's address"."""

WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::"})
"""Bind addresses that mean every interface, so say nothing about which one to advertise."""

LOOPBACK: Final = "127.0.0.1"


def advertised_host(configured: str, *, bind_host: str | None = None) -> str:
    """The address to hand to other hosts (the precedence in the module docstring)."""
    if configured != AUTO:
        return configured
    if bind_host is not None and bind_host not in WILDCARD_HOSTS:
        return bind_host
    return this_host_address()


def this_host_address() -> str:
    """The address this host's name resolves to (in a container: its address on the
    container network), unless that is a loopback address (Debian-style ``/etc/hosts``
    maps the host name to 127.0.1.1): then the address of the interface outbound
    traffic leaves by; loopback when neither is known."""
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback:
            return address
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))  # UDP: no packet is sent
        return str(probe.getsockname()[0])
    return LOOPBACK
