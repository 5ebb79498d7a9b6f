"""Image bytes: which formats are accepted, how they are decoded, how they are named.

An image is named by the SHA-256 of its bytes (never by its URL), so the same picture
sent under two URLs, or once as a URL and once inline, is one image to every cache.
Only JPEG, PNG and WEBP are accepted, at most ``MAX_ASPECT_RATIO`` times longer than
wide (or wider than long): a 1,048,576 x 16 strip passes a pixel cap but can blow up a
vision processor's resize. Everything is decoded to RGB.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from shared.errors import InvalidImage
from shared.settings import ImageSettings

if TYPE_CHECKING:
    from PIL.Image import Image

FORMATS: Final = ("JPEG", "PNG", "WEBP")
MAX_ASPECT_RATIO: Final = 200
"""The longer side over the shorter one (Qwen2-VL's image processor refuses past 200)."""
_MAGIC: Final = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
)


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sniff_format(data: bytes) -> str | None:
    """JPEG, PNG or WEBP from the first bytes; None for anything else."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int

    @classmethod
    def from_settings(cls, settings: ImageSettings) -> ImageLimits:
        return cls(max_bytes=settings.image_max_bytes, max_pixels=settings.image_max_pixels)


def check_image(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """Validate without decoding pixels; returns (width, height). Raises InvalidImage."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise InvalidImage(f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    if sniff_format(data) is None:
        raise InvalidImage("not a JPEG, PNG or WEBP image")
    try:
        with PILImage.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise InvalidImage(f"image format {image.format} is not JPEG, PNG or WEBP")
            width, height = image.size
            _check_size(width, height, limits)
            image.verify()
    except PILImage.DecompressionBombError as exc:  # more pixels than Pillow opens at all
        raise InvalidImage(f"image has too many pixels; the limit is {limits.max_pixels}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InvalidImage(f"the image cannot be decoded: {exc}") from exc
    return width, height


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise InvalidImage(
            f"image is {width}x{height} pixels; the limit is {limits.max_pixels} pixels"
        )
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidImage(
            f"image is {width}x{height} pixels; one side may be at most {MAX_ASPECT_RATIO} "
            "times the other"
        )


def decode_rgb(data: bytes) -> Image:
    """Decode (already checked) bytes to an RGB image."""
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class DecodedImageCache:
    """A small LRU of decoded RGB images, keyed by content hash and bounded by pixels' bytes."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._images: OrderedDict[str, Image] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> Image | None:
        with self._lock:
            image = self._images.get(digest)
            if image is not None:
                self._images.move_to_end(digest)
            return image

    def put(self, digest: str, image: Image) -> None:
        size = image.width * image.height * 3
        if size > self._max_bytes:
            return
        with self._lock:
            if digest in self._images:
                return
            self._images[digest] = image
            self._bytes += size
            while self._bytes > self._max_bytes:
                _, evicted = self._images.popitem(last=False)
                self._bytes -= evicted.width * evicted.height * 3

    @property
    def nbytes(self) -> int:
        return self._bytes
