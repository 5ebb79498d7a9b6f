"""Where a prefill worker tells decode workers to reach its NIXL side channel."""

from __future__ import annotations

from shared.settings import Settings
from workers.engines.host_address import this_host_address
from workers.engines.vllm.placement import side_channel_host


def test_loopback_by_default_for_one_host() -> None:
    assert side_channel_host(Settings()) == "127.0.0.1"


def test_auto_is_this_hosts_address() -> None:
    """In a container that is its address on the compose network (the rule and its
    fallbacks: tests/unit/test_host_address.py)."""
    assert side_channel_host(Settings(kv_side_channel_host="auto")) == this_host_address()


def test_an_explicit_address_is_kept() -> None:
    assert side_channel_host(Settings(kv_side_channel_host="10.0.0.7")) == "10.0.0.7"
