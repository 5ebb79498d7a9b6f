"""The gateway's image pipeline: bad images are 400s naming the part and nothing is stored;
good ones are stored once per content, and the prompt holds one placeholder per image."""

from __future__ import annotations

import base64
import io
import zlib

import fakeredis.aioredis
import pytest
from PIL import Image

from gateway.catalog.served_models import ServedModel
from gateway.dispatch.plan import Deadline
from gateway.images.fetch import FetchPolicy, ImageFetcher
from gateway.images.inputs import ImageInputs
from gateway.openai.schemas import ChatCompletionRequest
from gateway.serving import translate
from shared.errors import InvalidImage, InvalidRequest
from shared.images import ImageLimits, check_image, content_hash, sniff_format
from shared.protocol import ImageRef
from shared.queue import names
from shared.queue.media_store import ImageStore
from tests.support.tiny_model import build_vision_model
from workers.engines.vision.embedding_cache import EmbeddingCache


def _image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 8), color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return build_vision_model(tmp_path_factory.mktemp("vision-tokenizer"))


@pytest.fixture
def redis() -> fakeredis.aioredis.FakeRedis:
    return fakeredis.aioredis.FakeRedis()


@pytest.fixture
def inputs(redis: fakeredis.aioredis.FakeRedis) -> ImageInputs:
    policy = FetchPolicy(
        frozenset({"http", "https", "data"}), max_bytes=50_000, timeout_s=2.0, private_networks=()
    )
    return ImageInputs(
        ImageFetcher(policy), ImageStore(redis), ImageLimits(50_000, 256 * 256), max_images=3
    )


def _request(*parts: dict[str, object]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "tiny-vl",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}
            ],
        }
    )


async def collect(
    inputs: ImageInputs, request: ChatCompletionRequest, model: ServedModel
) -> tuple[ImageRef, ...]:
    """What the serving step does: the cheap checks, then the fetch (30 s deadline)."""
    return await inputs.load(inputs.parts(request, model), Deadline.after(30))


def _image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_images_are_stored_once_by_content(
    inputs: ImageInputs, vision_model: ServedModel, redis: fakeredis.aioredis.FakeRedis
) -> None:
    png = _image_bytes()
    # The same bytes under two URLs (two data: spellings) are one image.
    request = _request(
        _image(_data_url(png)),
        _image(_data_url(png, "image/x-png")),
        _image(_data_url(_image_bytes(color="blue"))),
    )
    refs = await collect(inputs, request, vision_model)
    assert [ref.digest for ref in refs][:2] == [content_hash(png)] * 2
    assert refs[2].digest != refs[0].digest
    assert await redis.get(names.image(content_hash(png))) == png
    assert 30 < await redis.ttl(names.image(content_hash(png))) <= 30 + 120
    prompt = translate.chat_prompt(request, vision_model, len(refs))
    assert prompt.count(vision_model.image_token_id) == 3  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        (_image("ftp://example.com/a.png"), "scheme 'ftp' is not allowed"),
        (_image("http://10.0.0.1/a.png"), "non-public address"),
        (_image("http://169.254.169.254/latest/meta-data"), "non-public address"),
        (_image(_data_url(b"hello, not an image")), "not a JPEG, PNG or WEBP"),
        (_image(_data_url(b"GIF89a" + b"0" * 20, "image/gif")), "not a JPEG, PNG or WEBP"),
        (_image("data:image/png;base64,%%%not-base64"), "broken base64"),
        (_image(_data_url(b"0" * 60_000)), "the limit is 50000"),
        (_image(_data_url(_image_bytes(size=(300, 300)))), "pixels"),
        (_image(_data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)), "cannot be decoded"),
    ],
)
async def test_bad_images_are_400s_naming_the_part(
    inputs: ImageInputs,
    vision_model: ServedModel,
    redis: fakeredis.aioredis.FakeRedis,
    part: dict[str, object],
    reason: str,
) -> None:
    request = _request(_image(_data_url(_image_bytes())), part)
    with pytest.raises(InvalidRequest, match=reason) as caught:
        await collect(inputs, request, vision_model)
    assert caught.value.status == 400
    assert caught.value.param == "messages[0].content[2]"
    assert await redis.keys("*") == []  # nothing stored, so nothing queued


async def test_too_many_images(inputs: ImageInputs, vision_model: ServedModel) -> None:
    request = _request(*[_image(_data_url(_image_bytes())) for _ in range(4)])
    with pytest.raises(InvalidRequest, match="4 images in one request; the limit is 3"):
        await collect(inputs, request, vision_model)


async def test_text_only_model_refuses_images(
    inputs: ImageInputs, served_model: ServedModel
) -> None:
    request = _request(_image(_data_url(_image_bytes())))
    with pytest.raises(InvalidRequest, match="text-only model") as caught:
        await collect(inputs, request, served_model)
    assert caught.value.param == "messages[0].content[1]"


def test_formats_are_sniffed_not_trusted() -> None:
    assert sniff_format(_image_bytes("PNG")) == "PNG"
    assert sniff_format(_image_bytes("JPEG")) == "JPEG"
    assert sniff_format(_image_bytes("WEBP")) == "WEBP"
    assert sniff_format(_image_bytes("GIF")) is None
    assert check_image(_image_bytes("WEBP", size=(5, 7)), ImageLimits(10**6, 10**6)) == (5, 7)


def test_embedding_cache_never_exceeds_its_bound() -> None:
    cache = EmbeddingCache(max_bytes=1000)
    for index in range(20):
        cache.put(f"d{index}", bytes(300))
        assert cache.stats.bytes <= 1000
    assert cache.stats.entries == 3 and cache.stats.evictions == 17
    assert cache.get("d19") is not None and cache.get("d0") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    cache.put("huge", bytes(5000))  # bigger than the bound: not kept
    assert cache.get("huge") is None and cache.stats.bytes <= 1000


async def test_stored_images_live_no_longer_than_the_setting_whatever_the_deadline(
    vision_model: ServedModel, redis: fakeredis.aioredis.FakeRedis
) -> None:
    policy = FetchPolicy(frozenset({"data"}), max_bytes=50_000, timeout_s=2.0, private_networks=())
    inputs = ImageInputs(
        ImageFetcher(policy),
        ImageStore(redis),
        ImageLimits(50_000, 256 * 256),
        max_images=3,
        store_ttl_s=300,
    )
    request = _request(_image(_data_url(_image_bytes())))
    [ref] = await inputs.load(inputs.parts(request, vision_model), Deadline.after(3600))
    assert 0 < await redis.ttl(names.image(ref.digest)) <= 300


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` (no pixel data: Pillow reads the header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data).to_bytes(4, "big")
        return len(data).to_bytes(4, "big") + kind + data + crc

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize("size", [(3300, 16), (16, 3300), (1_048_576, 16)])
def test_an_extreme_aspect_ratio_is_refused(size: tuple[int, int]) -> None:
    data = _image_bytes(size=size) if max(size) < 10_000 else _png_header(*size)
    with pytest.raises(InvalidImage, match="200 times the other"):
        check_image(data, ImageLimits(max_bytes=10**8, max_pixels=2**30))
    assert check_image(_image_bytes(size=(400, 2)), ImageLimits(10**8, 2**30)) == (400, 2)


def test_a_decompression_bomb_is_an_invalid_image() -> None:
    """Past Pillow's own limit (2 x 89 M pixels) it will not open the image at all."""
    with pytest.raises(InvalidImage, match="too many pixels") as caught:
        check_image(_png_header(20_000, 20_000), ImageLimits(max_bytes=10**8, max_pixels=2**40))
    assert caught.value.status == 400
