"""The one rule for the address other hosts reach this worker at (both engines use it)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from workers.engines import host_address
from workers.engines.host_address import AUTO, advertised_host, this_host_address


def test_a_configured_address_wins_over_everything() -> None:
    assert advertised_host("10.0.0.7") == "10.0.0.7"
    assert advertised_host("10.0.0.7", bind_host="192.168.1.7") == "10.0.0.7"


def test_auto_takes_a_specific_bind_address() -> None:
    assert advertised_host(AUTO, bind_host="192.168.1.7") == "192.168.1.7"


@pytest.mark.parametrize("bind_host", [None, "0.0.0.0", "::", ""])
def test_auto_with_no_specific_bind_address_is_this_hosts_address(bind_host: str | None) -> None:
    assert advertised_host(AUTO, bind_host=bind_host) == this_host_address()


def test_this_host_address_is_what_the_host_name_resolves_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a container: its address on the container network."""
    monkeypatch.setattr(host_address.socket, "gethostbyname", lambda name: "172.18.0.5")
    assert this_host_address() == "172.18.0.5"


def test_a_loopback_host_name_falls_back_to_the_outbound_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Debian-style /etc/hosts maps the host name to 127.0.1.1, which no other host reaches."""
    monkeypatch.setattr(host_address.socket, "gethostbyname", lambda name: "127.0.1.1")

    class Probe:
        def __init__(self, *args: Any) -> None:
            pass

        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

        def connect(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("10.1.2.3", 40000)

    monkeypatch.setattr(host_address.socket, "socket", Probe)
    assert this_host_address() == "10.1.2.3"


def test_loopback_when_nothing_else_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> Any:
        raise OSError("no network")

    monkeypatch.setattr(host_address.socket, "gethostbyname", fail)
    monkeypatch.setattr(host_address.socket, "socket", fail)
    assert this_host_address() == "127.0.0.1"


def test_the_real_lookup_gives_an_address() -> None:
    socket.inet_aton(this_host_address())
