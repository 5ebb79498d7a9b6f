"""Fetch the bytes behind an image URL (http, https or data:), guarded against SSRF.

Every hop is checked before it is connected to: the scheme must be allowed, and
every address the host name resolves to must be public unless an operator has
allowed its network (``CONVEYOR_IMAGE_PRIVATE_NETWORKS``). Redirects are
followed by hand so each target is checked again. The connection goes to the
address that was checked (the Host header and TLS name stay the original host),
so a DNS answer that changes between check and connect cannot slip through.
A whole fetch (every redirect, name lookup and byte) must end within ``timeout_s``,
so a server dripping a byte at a time cannot hold it open. Bodies are read as sent
(``Accept-Encoding: identity``): a gzip or brotli response is refused, never inflated
past the size cap. Concurrent fetches of the same URL share one download.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote_to_bytes, urljoin, urlsplit

import httpx

from shared.errors import ImageFetchError
from shared.settings import ImageSettings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

MAX_REDIRECTS = 5


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    schemes: frozenset[str]
    max_bytes: int
    timeout_s: float
    private_networks: tuple[IPNetwork, ...]
    """Non-public networks an operator allows (e.g. an internal image store)."""

    @classmethod
    def from_settings(cls, settings: ImageSettings) -> FetchPolicy:
        return cls(
            schemes=allowed_schemes(settings.image_url_schemes),
            max_bytes=settings.image_max_bytes,
            timeout_s=settings.image_fetch_timeout_s,
            private_networks=cls.parse_networks(settings.image_private_networks),
        )

    @classmethod
    def parse_networks(cls, text: str) -> tuple[IPNetwork, ...]:
        return tuple(
            ipaddress.ip_network(part.strip(), strict=False)
            for part in text.split(",")
            if part.strip()
        )


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0]) for info in infos]


class ImageFetcher:
    def __init__(
        self,
        policy: FetchPolicy,
        *,
        resolver: Resolver = system_resolver,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._policy = policy
        self._resolve = resolver
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            timeout=policy.timeout_s,
            transport=transport,
            trust_env=False,  # an HTTP(S)_PROXY would hide the real target from the guard
        )
        self._inflight: dict[str, asyncio.Future[bytes]] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str) -> bytes:
        """The bytes at ``url``; raises ImageFetchError with the reason."""
        scheme = split_url(url).scheme.lower()
        self._check_scheme(scheme)
        if scheme == "data":
            return self._decode_data_url(url)
        running = self._inflight.get(url)
        if running is not None:
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise  # this request was cancelled
                # the request that was downloading left: download it here
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._inflight[url] = future
        try:
            data = await self._download_in_time(url)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        else:
            future.set_result(data)
            return data
        finally:
            del self._inflight[url]

    # ------------------------------------------------------------------ data: URLs

    def _decode_data_url(self, url: str) -> bytes:
        header, comma, payload = url[5:].partition(",")
        if not comma:
            raise ImageFetchError("malformed data: URL (no comma)")
        params = header.split(";")
        if not params[0].lower().startswith("image/"):
            raise ImageFetchError(f"data: URL media type must be image/*, not {params[0]!r}")
        if "base64" not in (p.lower() for p in params[1:]):
            raise ImageFetchError("data: URL must be base64-encoded (data:image/...;base64,...)")
        if len(payload) * 3 // 4 > self._policy.max_bytes + 3:
            raise ImageFetchError(self._too_big(len(payload) * 3 // 4))
        try:
            data = base64.b64decode(unquote_to_bytes(payload), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageFetchError(f"data: URL holds broken base64 ({exc})") from exc
        if len(data) > self._policy.max_bytes:
            raise ImageFetchError(self._too_big(len(data)))
        return data

    # ----------------------------------------------------------------- http(s) URLs

    async def _download_in_time(self, url: str) -> bytes:
        try:
            async with asyncio.timeout(self._policy.timeout_s):
                return await self._download(url)
        except TimeoutError as exc:
            raise ImageFetchError(
                f"fetching {url!r} took longer than {self._policy.timeout_s:g}s"
            ) from exc

    async def _download(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            parts = split_url(url)
            self._check_scheme(parts.scheme.lower())
            if parts.scheme.lower() == "data":
                raise ImageFetchError("a redirect to a data: URL is not followed")
            host, port = host_and_port(parts, url)
            address = await self._checked_address(host, port)
            location, body = await self._get(url, host, address)
            if location is None:
                return body
            url = urljoin(url, location)
        raise ImageFetchError(f"more than {MAX_REDIRECTS} redirects")

    async def _checked_address(self, host: str, port: int) -> IPAddress:
        try:
            addresses = [ipaddress.ip_address(host.strip("[]"))]
        except ValueError:
            try:
                addresses = await asyncio.wait_for(
                    self._resolve(host, port), self._policy.timeout_s
                )
            except (OSError, TimeoutError, ValueError) as exc:  # UnicodeError: a bad IDNA name
                reason = exc or "timeout"
                raise ImageFetchError(f"cannot resolve host {host[:256]!r}: {reason}") from exc
        if not addresses:
            raise ImageFetchError(f"host {host!r} has no address")
        for address in addresses:
            if not self._allowed(address):
                raise ImageFetchError(
                    f"host {host!r} resolves to {address}, a non-public address; image URLs "
                    "must point to the public internet (an operator can allow networks with "
                    "CONVEYOR_IMAGE_PRIVATE_NETWORKS)"
                )
        return addresses[0]

    def _allowed(self, address: IPAddress) -> bool:
        """An IPv6 address that carries an IPv4 one (mapped, compatible, NAT64, 6to4,
        Teredo) is judged by every IPv4 address it carries: each reaches that host
        (unless the operator allowed the IPv6 network itself)."""
        if any(address in network for network in self._policy.private_networks):
            return True
        if isinstance(address, ipaddress.IPv6Address):
            carried = embedded_ipv4(address)
            if carried:
                return all(self._allowed(inner) for inner in carried)
        return address.is_global and not address.is_multicast

    async def _get(self, url: str, host: str, address: IPAddress) -> tuple[str | None, bytes]:
        """GET ``url`` from ``address``: (redirect target, b"") or (None, body)."""
        parts = urlsplit(url)
        literal = f"[{address}]" if address.version == 6 else str(address)
        netloc = literal if parts.port is None else f"{literal}:{parts.port}"
        pinned = parts._replace(netloc=netloc).geturl()
        headers = {
            "Host": parts.netloc.rpartition("@")[2],
            "Accept": "image/*",
            "Accept-Encoding": "identity",
        }
        try:
            async with self._client.stream(
                "GET", pinned, headers=headers, extensions={"sni_hostname": host}
            ) as response:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise ImageFetchError(f"redirect without a Location from {url!r}")
                    return location, b""
                if response.status_code != 200:
                    raise ImageFetchError(f"fetching {url!r} returned HTTP {response.status_code}")
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise ImageFetchError(
                        f"{url!r} answered with Content-Encoding {encoding[:32]!r}; images "
                        "are fetched uncompressed (Accept-Encoding: identity)"
                    )
                declared = response.headers.get("content-length")
                if (
                    declared
                    and declared.isascii()
                    and declared.isdigit()
                    and int(declared) > self._policy.max_bytes
                ):
                    raise ImageFetchError(self._too_big(int(declared)))
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > self._policy.max_bytes:
                        raise ImageFetchError(self._too_big(size, at_least=True))
                    chunks.append(chunk)
        except httpx.TimeoutException as exc:
            raise ImageFetchError(
                f"fetching {url!r} timed out after {self._policy.timeout_s:g}s"
            ) from exc
        except httpx.HTTPError as exc:
            raise ImageFetchError(f"cannot fetch {url!r}: {exc or type(exc).__name__}") from exc
        return None, b"".join(chunks)

    def _check_scheme(self, scheme: str) -> None:
        if scheme not in self._policy.schemes:
            allowed = ", ".join(sorted(self._policy.schemes))
            raise ImageFetchError(
                f"image URL scheme {scheme!r} is not allowed (allowed: {allowed})"
            )

    def _too_big(self, size: int, *, at_least: bool = False) -> str:
        more = "more than " if at_least else ""
        return f"image is {more}{size} bytes; the limit is {self._policy.max_bytes}"


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to: IPv4-mapped (``::ffff:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``), NAT64 (``64:ff9b::/96``), 6to4 (``2002::/16``) and
    Teredo (``2001::/32``: server and client). Empty for a plain IPv6 address."""
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address in NAT64 or address in IPV4_COMPATIBLE:
        return [ipaddress.IPv4Address(address.packed[12:])]
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    return []


def split_url(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:  # e.g. "http://[::1" (an unclosed IPv6 literal)
        raise ImageFetchError(f"malformed image URL {url[:256]!r}: {exc}") from exc


def host_and_port(parts: SplitResult, url: str) -> tuple[str, int]:
    """The host (IDNA-checked) and port of an http(s) URL; ImageFetchError if malformed."""
    try:
        host, port = parts.hostname, parts.port
        if host:
            host.encode("idna")  # a label over 63 characters, an empty label, ...
    except ValueError as exc:  # UnicodeError is one
        raise ImageFetchError(f"malformed image URL {url[:256]!r}: {exc}") from exc
    if not host:
        raise ImageFetchError(f"URL has no host: {url[:256]!r}")
    return host, port or (443 if parts.scheme.lower() == "https" else 80)


def allowed_schemes(text: str | Sequence[str]) -> frozenset[str]:
    parts = text.split(",") if isinstance(text, str) else text
    return frozenset(part.strip().lower() for part in parts if part.strip())
