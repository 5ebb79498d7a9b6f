"""Where a prefill worker tells decode workers to reach its NIXL side channel."""

from __future__ import annotations

import socket

from shared.settings import Settings
from workers.engines.vllm.placement import side_channel_host


def test_loopback_by_default_for_one_host() -> None:
    assert side_channel_host(Settings()) == "127.0.0.1"


def test_auto_is_the_address_this_host_name_resolves_to() -> None:
    """In a container that is its address on the compose network."""
    expected = socket.gethostbyname(socket.gethostname())
    assert side_channel_host(Settings(kv_side_channel_host="auto")) == expected


def test_an_explicit_address_is_kept() -> None:
    assert side_channel_host(Settings(kv_side_channel_host="10.0.0.7")) == "10.0.0.7"
