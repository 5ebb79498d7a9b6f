"""Image URL fetching: schemes, data: URLs, byte limits and the SSRF guard, against a real
HTTP server on loopback (allowed explicitly, as an operator would allow an image store)."""

from __future__ import annotations

import base64
import gzip
import http.server
import ipaddress
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.images.fetch import FetchPolicy, ImageFetcher, IPAddress, embedded_ipv4
from shared.errors import ImageFetchError

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
LOOPBACK = FetchPolicy.parse_networks("127.0.0.1/32")


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts_seen: list[str] = []
    hits: list[str] = []

    def do_GET(self) -> None:
        _Handler.hosts_seen.append(self.headers.get("Host", ""))
        _Handler.hits.append(self.path)
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/redirect?to="))
            self.end_headers()
            return
        if self.path == "/drip":  # a byte at a time, each well within a read timeout
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"0")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if self.path == "/gzip":
            body = gzip.compress(b"\x89PNG\r\n\x1a\n" + b"0" * 1_000_000)  # ~1 KiB sent
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/big":
            body = b"\x89PNG\r\n\x1a\n" + b"0" * 5000
        elif self.path == "/missing":
            self.send_response(404)
            self.end_headers()
            return
        else:
            body = PNG
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _policy(**overrides: object) -> FetchPolicy:
    values: dict[str, object] = {
        "schemes": frozenset({"http", "https", "data"}),
        "max_bytes": 4096,
        "timeout_s": 5.0,
        "private_networks": LOOPBACK,
    }
    values.update(overrides)
    return FetchPolicy(**values)  # type: ignore[arg-type]


def _resolver(table: dict[str, str]):  # type: ignore[no-untyped-def]
    async def resolve(host: str, port: int) -> list[IPAddress]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return [ipaddress.ip_address(table[host])]

    return resolve


async def test_fetches_from_an_allowed_server(server: str) -> None:
    fetcher = ImageFetcher(_policy())
    try:
        assert await fetcher.fetch(f"{server}/cat.png") == PNG
    finally:
        await fetcher.aclose()


async def test_connects_to_the_checked_address_with_the_original_host_header(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    fetcher = ImageFetcher(_policy(), resolver=_resolver({"images.example": "127.0.0.1"}))
    try:
        assert await fetcher.fetch(f"http://images.example:{port}/a.png") == PNG
    finally:
        await fetcher.aclose()
    assert _Handler.hosts_seen[-1] == f"images.example:{port}"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/x.png",
        "http://10.1.2.3/x.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::127.0.0.1]/x.png",  # IPv4-compatible
        "http://[::a9fe:a9fe]/latest/meta-data",
        "http://[64:ff9b::7f00:1]/x.png",  # NAT64
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data",
        "http://[2002:7f00:1::]/x.png",  # 6to4
        "http://[2002:a9fe:a9fe::1]/latest/meta-data",
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/x.png",  # Teredo, client 127.0.0.1
        "http://[::1]/x.png",
        "http://[::ffff:10.0.0.1]/x.png",
        "http://0.0.0.0/x.png",
    ],
)
async def test_refuses_non_public_addresses(url: str) -> None:
    fetcher = ImageFetcher(_policy(private_networks=()))
    try:
        with pytest.raises(ImageFetchError, match="non-public address"):
            await fetcher.fetch(url)
    finally:
        await fetcher.aclose()


async def test_refuses_a_name_that_resolves_to_a_private_address() -> None:
    fetcher = ImageFetcher(_policy(), resolver=_resolver({"evil.example": "192.168.1.10"}))
    try:
        with pytest.raises(ImageFetchError, match=r"evil.example.*192\.168\.1\.10"):
            await fetcher.fetch("http://evil.example/x.png")
    finally:
        await fetcher.aclose()


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/internal.png",
        "file:///etc/passwd",
    ],
)
async def test_checks_every_redirect(server: str, target: str) -> None:
    fetcher = ImageFetcher(_policy())
    hits = len(_Handler.hits)
    try:
        with pytest.raises(ImageFetchError, match=r"non-public|scheme"):
            await fetcher.fetch(f"{server}/redirect?to={target}")
    finally:
        await fetcher.aclose()
    assert len(_Handler.hits) == hits + 1  # only the first hop was fetched


async def test_follows_a_redirect_to_an_allowed_place(server: str) -> None:
    fetcher = ImageFetcher(_policy())
    try:
        assert await fetcher.fetch(f"{server}/redirect?to=/cat.png") == PNG
    finally:
        await fetcher.aclose()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://example.com/x.png", "scheme 'ftp' is not allowed"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("data:image/png;base64,@@@@", "broken base64"),
        ("data:text/plain;base64,aGVsbG8=", "must be image/"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64", "no comma"),
        ("http://[::1/x.png", "malformed image URL"),
        ("http://example.com:99999/x.png", "malformed image URL"),
        ("http://" + "a" * 64 + ".example.com/x.png", "malformed image URL"),
        ("http://a..example.com/x.png", "malformed image URL"),
    ],
)
async def test_refuses_bad_urls(url: str, reason: str) -> None:
    fetcher = ImageFetcher(_policy())
    try:
        with pytest.raises(ImageFetchError, match=reason):
            await fetcher.fetch(url)
    finally:
        await fetcher.aclose()


async def test_data_urls_decode() -> None:
    fetcher = ImageFetcher(_policy())
    try:
        url = "data:image/png;base64," + base64.b64encode(PNG).decode()
        assert await fetcher.fetch(url) == PNG
    finally:
        await fetcher.aclose()


async def test_size_limit_for_downloads_and_data_urls(server: str) -> None:
    fetcher = ImageFetcher(_policy(max_bytes=1000))
    try:
        with pytest.raises(ImageFetchError, match="the limit is 1000"):
            await fetcher.fetch(f"{server}/big")
        with pytest.raises(ImageFetchError, match="the limit is 1000"):
            await fetcher.fetch("data:image/png;base64," + base64.b64encode(b"0" * 2000).decode())
    finally:
        await fetcher.aclose()


async def test_unreachable_and_missing(server: str) -> None:
    fetcher = ImageFetcher(_policy(), resolver=_resolver({}))
    try:
        with pytest.raises(ImageFetchError, match="HTTP 404"):
            await fetcher.fetch(f"{server}/missing")
        with pytest.raises(ImageFetchError, match="cannot resolve host"):
            await fetcher.fetch("http://nowhere.example/x.png")
        with pytest.raises(ImageFetchError, match="cannot fetch"):
            await fetcher.fetch("http://127.0.0.1:9/x.png")  # allowed, but nothing listens
    finally:
        await fetcher.aclose()


async def test_concurrent_fetches_of_one_url_share_a_download(server: str) -> None:
    import asyncio

    fetcher = ImageFetcher(_policy())
    hits = len(_Handler.hits)
    try:
        results = await asyncio.gather(*(fetcher.fetch(f"{server}/same.png") for _ in range(5)))
    finally:
        await fetcher.aclose()
    assert results == [PNG] * 5
    assert len(_Handler.hits) == hits + 1


async def test_a_waiter_survives_the_downloader_leaving(server: str) -> None:
    import asyncio

    fetcher = ImageFetcher(_policy())
    try:
        first = asyncio.create_task(fetcher.fetch(f"{server}/shared.png"))
        await asyncio.sleep(0)
        second = asyncio.create_task(fetcher.fetch(f"{server}/shared.png"))
        await asyncio.sleep(0)
        first.cancel()
        assert await second == PNG
        assert first.cancelled()
    finally:
        await fetcher.aclose()


async def test_a_whole_fetch_has_one_deadline(server: str) -> None:
    fetcher = ImageFetcher(_policy(timeout_s=0.5))
    started = time.monotonic()
    with pytest.raises(ImageFetchError, match=r"took longer than 0\.5s"):
        await fetcher.fetch(f"{server}/drip")
    assert time.monotonic() - started < 3.0  # the whole drip takes 4 s
    await fetcher.aclose()


async def test_a_compressed_response_is_refused_not_inflated(server: str) -> None:
    fetcher = ImageFetcher(_policy())
    with pytest.raises(ImageFetchError, match="Content-Encoding 'gzip'"):
        await fetcher.fetch(f"{server}/gzip")
    await fetcher.aclose()


@pytest.mark.parametrize(
    ("address", "carried"),
    [
        ("::ffff:10.0.0.1", ["10.0.0.1"]),
        ("::10.0.0.1", ["10.0.0.1"]),
        ("64:ff9b::8.8.8.8", ["8.8.8.8"]),
        ("2002:0808:0808::", ["8.8.8.8"]),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", ["65.54.227.120", "127.0.0.1"]),
        ("2001:4860:4860::8888", []),
    ],
)
def test_ipv6_addresses_that_carry_ipv4_ones(address: str, carried: list[str]) -> None:
    found = embedded_ipv4(ipaddress.IPv6Address(address))
    assert [str(inner) for inner in found] == carried


async def test_a_carried_public_ipv4_address_is_allowed() -> None:
    fetcher = ImageFetcher(_policy(private_networks=()))
    assert fetcher._allowed(ipaddress.ip_address("64:ff9b::808:808"))
    assert not fetcher._allowed(ipaddress.ip_address("64:ff9b::a00:1"))
    await fetcher.aclose()
