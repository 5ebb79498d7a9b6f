"""The images of a chat request: found, fetched, validated and stored before queueing.

Nothing is queued for a request whose images fail: every part is fetched
(concurrently), checked (JPEG/PNG/WEBP, byte and pixel limits) and only then
stored in Redis under its content hash, for the encode or language worker.
Errors name the content part, e.g. ``messages[0].content[1]``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.image_fetch import ImageFetcher
from gateway.model_catalog import ServedModel
from gateway.schemas import ChatCompletionRequest, ImagePart
from shared.errors import ConveyorError, InvalidRequest
from shared.images import ImageLimits, check_image, content_hash
from shared.media_store import ImageStore
from shared.protocol import ImageRef

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
                found.append(ImagePartRef(f"messages[{position}].content[{index}]",
                                          part.image_url.url))
    return found


class ImageInputs:
    def __init__(
        self,
        fetcher: ImageFetcher,
        store: ImageStore,
        limits: ImageLimits,
        *,
        max_images: int,
    ) -> None:
        self._fetcher = fetcher
        self._store = store
        self._limits = limits
        self._max_images = max_images

    async def aclose(self) -> None:
        await self._fetcher.aclose()

    async def collect(
        self, request: ChatCompletionRequest, model: ServedModel, *, timeout_s: float
    ) -> tuple[ImageRef, ...]:
        parts = image_parts(request)
        if not parts:
            return ()
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
        loaded = await asyncio.gather(*(self._load(part) for part in parts),
                                      return_exceptions=True)
        images: list[tuple[str, bytes]] = []
        for outcome in loaded:
            if isinstance(outcome, BaseException):
                raise outcome
            images.append(outcome)
        await self._store.put_many(images, int(timeout_s) + STORE_MARGIN_S)
        return tuple(ImageRef(digest, len(data)) for digest, data in images)

    async def _load(self, part: ImagePartRef) -> tuple[str, bytes]:
        try:
            data = await self._fetcher.fetch(part.url)
            await asyncio.to_thread(check_image, data, self._limits)
        except ConveyorError as exc:
            error = type(exc)(f"{part.param}: {exc.message}", param=part.param)
            raise error from exc
        return content_hash(data), data
