"""The images of a chat request: found and counted, then fetched, validated and stored.

Two steps, so the serving step can put its cheap checks first: :meth:`ImageInputs.parts`
finds the image parts and checks them without I/O (a text-only model, too many
images); :meth:`ImageInputs.load` runs only once the text is known to fit. Nothing
is queued for a request whose images fail: every part is fetched (concurrently),
checked (JPEG/PNG/WEBP, byte and pixel limits) and only then stored in Redis under
its content hash, for the encode or language worker. Errors name the content part,
e.g. ``messages[0].content[1]``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from gateway.catalog.served_models import ServedModel
from gateway.dispatch.plan import Deadline
from gateway.images.fetch import ImageFetcher
from gateway.openai.schemas import ChatCompletionRequest, ImagePart
from shared.errors import ConveyorError, InvalidRequest
from shared.images import ImageLimits, check_image, content_hash
from shared.protocol import ImageRef
from shared.queue.media_store import ImageStore

STORE_MARGIN_S = 120
"""Images outlive their request's deadline by this much (queueing, retries, migration)."""


@dataclass(frozen=True, slots=True)
class ImagePartRef:
    param: str
    url: str


def image_parts(request: ChatCompletionRequest) -> list[ImagePartRef]:
    found = []
    for position, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for index, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                found.append(
                    ImagePartRef(f"messages[{position}].content[{index}]", part.image_url.url)
                )
    return found


class _RequestBytes:
    """The bytes fetched so far for one request, against its cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fetched = 0

    def check(self, more: int = 0) -> None:
        self.fetched += more
        if self.fetched > self.limit:
            raise InvalidRequest(
                f"the request's images pass {self.limit} bytes in all "
                "(CONVEYOR_IMAGE_MAX_REQUEST_BYTES); send fewer or smaller images"
            )


class ImageInputs:
    def __init__(
        self,
        fetcher: ImageFetcher,
        store: ImageStore,
        limits: ImageLimits,
        *,
        max_images: int,
        max_request_bytes: int = 2**62,
        store_ttl_s: int = 3600,
    ) -> None:
        self._fetcher = fetcher
        self._store = store
        self._limits = limits
        self._max_images = max_images
        self._max_request_bytes = max_request_bytes
        self._store_ttl_s = store_ttl_s

    async def aclose(self) -> None:
        await self._fetcher.aclose()

    def parts(self, request: ChatCompletionRequest, model: ServedModel) -> list[ImagePartRef]:
        """The request's image parts, checked without fetching anything: images sent to a
        text-only model, or more than the limit, are a 400 here."""
        parts = image_parts(request)
        if not parts:
            return parts
        if model.image_token_id is None:
            raise InvalidRequest(
                f"`{model.name}` is a text-only model and does not accept image content "
                "parts; send text, or use a vision-language model",
                param=parts[0].param,
            )
        if len(parts) > self._max_images:
            raise InvalidRequest(
                f"{len(parts)} images in one request; the limit is {self._max_images} "
                "(CONVEYOR_MAX_IMAGES_PER_REQUEST)",
                param="messages",
            )
        return parts

    async def load(
        self, parts: list[ImagePartRef], deadline: Deadline, store: ImageStore | None = None
    ) -> tuple[ImageRef, ...]:
        """Fetch and check every part (concurrently), then store them all (in ``store``:
        the Redis of the request's model; default the one given at construction) until
        ``STORE_MARGIN_S`` after the request's deadline, at most ``store_ttl_s``; the first
        failure is raised, the other fetches are cancelled and nothing is stored. Past
        ``max_request_bytes`` in all, no further fetch starts. The caller owns the stored
        images from here (the dispatcher releases them when the request ends or is refused)."""
        if not parts:
            return ()
        fetched = _RequestBytes(self._max_request_bytes)
        tasks = [asyncio.ensure_future(self._load(part, fetched)) for part in parts]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()  # a fetch cancelled here has stored nothing
        for task in tasks:  # the first failure in the order of the parts
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error
        images = [task.result() for task in tasks]
        ttl_s = max(1, math.ceil(deadline.remaining_s())) + STORE_MARGIN_S
        await (store or self._store).put_many(images, min(ttl_s, self._store_ttl_s))
        return tuple(ImageRef(digest, len(data)) for digest, data in images)

    async def _load(self, part: ImagePartRef, fetched: _RequestBytes) -> tuple[str, bytes]:
        try:
            fetched.check()  # over the cap already: fetch nothing more
            data = await self._fetcher.fetch(part.url)
            fetched.check(len(data))
            await asyncio.to_thread(check_image, data, self._limits)
        except ConveyorError as exc:
            error = type(exc)(f"{part.param}: {exc.message}", param=part.param)
            raise error from exc
        return content_hash(data), data
