"""The LoRA desired state in Redis (shared/queue/lora_registry.py): codec, atomic publish, reports.

On fakeredis and the real Redis. Also: the protocol and registry fields LoRA added keep
old and new readers compatible.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from shared.protocol import GenerateJob, SamplingOptions, decode, encode
from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import (
    LOADED,
    LOADING,
    LoraSpec,
    adapter_stream,
    decode_spec,
    desired_generation,
    encode_spec,
    failed,
    failure_reason,
    publish_desired,
    read_desired,
    rollout,
    serving_workers,
    validate_adapter_name,
    wait_for_rollout,
)
from shared.roles import Role

BASE = "tiny"
lora_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._\-/:]{0,40}", fullmatch=True)
specs = st.builds(LoraSpec, name=lora_names, path=st.text(max_size=60), base_model=st.text())


@given(specs)
def test_spec_round_trips(spec: LoraSpec) -> None:
    assert decode_spec(encode_spec(spec)) == spec


@pytest.mark.parametrize("data", [b"", b"2:\x80", b"1:", b"1:\xc1garbage", b"nonsense"])
def test_bad_spec_bytes_are_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_spec(data)


@pytest.mark.parametrize("name", ["", "-lead", "has space", "x" * 129, "é", "a\nb"])
def test_names_that_cannot_be_a_model_and_stream_name_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid adapter name"):
        validate_adapter_name(name)


def test_an_adapter_has_its_own_aggregated_stream() -> None:
    assert adapter_stream("sql-lora") == names.job_stream("sql-lora", Role.AGGREGATED)


async def test_publish_replaces_everything_and_bumps_the_generation(
    redis_backend: aioredis.Redis,
) -> None:
    assert await read_desired(redis_backend, BASE) is None  # unknown, not "empty"
    a = LoraSpec(name="a", path="/x/a", base_model=BASE)
    b = LoraSpec(name="b", path="/x/b", base_model=BASE)
    assert await publish_desired(redis_backend, BASE, [a, b]) == 1
    desired = await read_desired(redis_backend, BASE)
    assert desired is not None
    assert (desired.generation, dict(desired.specs)) == (1, {"a": a, "b": b})
    assert await publish_desired(redis_backend, BASE, [b]) == 2
    desired = await read_desired(redis_backend, BASE)
    assert desired is not None and dict(desired.specs) == {"b": b}
    assert await publish_desired(redis_backend, BASE, []) == 3
    desired = await read_desired(redis_backend, BASE)
    assert desired is not None and (desired.generation, dict(desired.specs)) == (3, {})
    assert await desired_generation(redis_backend, BASE) == 3
    assert await read_desired(redis_backend, "other-model") is None


async def test_publish_refuses_a_bad_set_and_writes_nothing(redis_backend: aioredis.Redis) -> None:
    good = LoraSpec(name="a", path="/x/a", base_model=BASE)
    for bad in (
        [good, LoraSpec(name="b", path="/x", base_model="elsewhere")],
        [good, good],
        [LoraSpec(name="bad name", path="/x", base_model=BASE)],
    ):
        with pytest.raises(ValueError):
            await publish_desired(redis_backend, BASE, bad)
    assert await read_desired(redis_backend, BASE) is None


async def test_concurrent_publishes_never_mix(redis_backend: aioredis.Redis) -> None:
    """Each publish is one MULTI: a reader sees one whole set, never a blend."""
    sets = [
        [LoraSpec(name=f"s{i}-{j}", path="/p", base_model=BASE) for j in range(5)]
        for i in range(20)
    ]
    await asyncio.gather(*(publish_desired(redis_backend, BASE, s) for s in sets))
    desired = await read_desired(redis_backend, BASE)
    assert desired is not None and desired.generation == 20
    assert len({name.split("-")[0] for name in desired.specs}) == 1


async def test_unreadable_entries_are_named_not_fatal(redis_backend: aioredis.Redis) -> None:
    good = LoraSpec(name="a", path="/x/a", base_model=BASE)
    await publish_desired(redis_backend, BASE, [good])
    await redis_backend.hset(
        names.adapters_desired(BASE),
        mapping={  # type: ignore[misc]
            "future": b"9:whatever",
            "renamed": encode_spec(LoraSpec(name="other", path="/x", base_model=BASE)),
        },
    )
    desired = await read_desired(redis_backend, BASE)
    assert desired is not None
    assert dict(desired.specs) == {"a": good}
    assert desired.undecodable == ("future", "renamed")


def registration(worker_id: str, **fields: object) -> WorkerRegistration:
    base: dict[str, object] = {
        "worker_id": worker_id,
        "role": Role.AGGREGATED,
        "model": BASE,
        "max_model_len": 2048,
        "active": 0,
        "slots": 8,
    }
    return msgspec.convert({**base, **fields}, WorkerRegistration)


def test_failed_reports_carry_their_reason() -> None:
    assert failed("no adapter folder at /x") == "failed: no adapter folder at /x"
    assert failure_reason(failed("line\nbreak")) == "line break"
    assert failure_reason(LOADED) is None


def test_rollout_counts_only_reports_of_the_generation() -> None:
    workers = [
        registration("w1", adapters={"a": LOADED}, adapters_generation=4),
        registration("w2", adapters={"a": failed("bad")}, adapters_generation=4),
        registration("w3", adapters={"a": LOADED}, adapters_generation=3),  # stale report
        registration("w4", adapters={"a": LOADING}, adapters_generation=4),
        registration(
            "p1",
            role=Role.PREFILL,
            adapters={"a": failed("aggregated only")},
            adapters_generation=4,
        ),
        registration("x1", model="other", adapters={"a": LOADED}, adapters_generation=9),
    ]
    state = rollout(workers, base_model=BASE, adapter="a", generation=4)
    assert state.loaded == ("w1",)
    assert dict(state.failed) == {"w2": "bad"}
    assert state.pending == ("w3", "w4")
    assert state.settled  # one worker has it: requests can run
    nowhere = rollout(workers[1:2], base_model=BASE, adapter="a", generation=4)
    assert nowhere.settled and not nowhere.loaded  # every worker answered: it failed
    assert not rollout(workers[3:4], base_model=BASE, adapter="a", generation=4).settled


def test_serving_workers_are_ready_undrained_and_loaded() -> None:
    workers = [
        registration("w1", adapters={"a": LOADED}),
        registration("w2", adapters={"a": LOADED}, draining=True, paused=True),
        registration("w3", adapters={"a": LOADED}, ready=False),
        registration("w4", adapters={"a": LOADING}),
    ]
    assert [w.worker_id for w in serving_workers(workers, "a")] == ["w1"]


async def test_wait_for_rollout_sees_the_registry(redis_backend: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_backend, ttl_s=30)
    await registry.beat(registration("w1", adapters={"a": LOADING}, adapters_generation=1))

    async def load_later() -> None:
        await asyncio.sleep(0.2)
        await registry.beat(registration("w1", adapters={"a": LOADED}, adapters_generation=1))

    task = asyncio.create_task(load_later())
    state = await wait_for_rollout(
        redis_backend, base_model=BASE, adapter="a", generation=1, timeout_s=5, poll_s=0.02
    )
    await task
    assert state.loaded == ("w1",)
    empty = await wait_for_rollout(
        redis_backend, base_model="nobody", adapter="a", generation=1, timeout_s=1
    )
    assert empty.settled and not empty.loaded and not empty.failed


# ------------------------------------------------------------------ compatibility


class OldGenerateJob(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag_field="kind", tag="generate"
):
    """GenerateJob as it was before ``adapter``."""

    request_id: str
    index: int
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    reply_to: str
    deadline_unix: float
    created_unix: float
    handoff: dict[str, object] | None = None
    images: tuple[object, ...] = ()
    images_encoded: bool = False
    after_encode: Role | None = None


def test_jobs_with_and_without_an_adapter_cross_versions() -> None:
    fields = {
        "request_id": "r",
        "index": 0,
        "model": "a",
        "prompt_token_ids": [1],
        "sampling": SamplingOptions(max_tokens=3),
        "reply_to": "x",
        "deadline_unix": 1.0,
        "created_unix": 0.0,
    }
    old_bytes = msgspec.msgpack.encode(OldGenerateJob(**fields))  # type: ignore[arg-type]
    message = decode(encode(GenerateJob(**fields)) | {b"m": old_bytes})  # type: ignore[arg-type]
    assert isinstance(message, GenerateJob) and message.adapter is None
    new = GenerateJob(**fields, adapter="a")  # type: ignore[arg-type]
    old = msgspec.msgpack.decode(encode(new)[b"m"], type=OldGenerateJob)  # an old reader
    assert old.model == "a"


def test_an_old_reader_decodes_a_registration_with_adapters() -> None:
    class OldRegistration(msgspec.Struct, kw_only=True):
        worker_id: str
        model: str
        ready: bool = True

    data = WorkerRegistry.encode(registration("w1", adapters={"a": LOADED}, paused=True))
    assert msgspec.json.decode(data, type=OldRegistration).worker_id == "w1"
    old_data = msgspec.json.encode(
        {
            "worker_id": "w1",
            "role": "aggregated",
            "model": BASE,
            "max_model_len": 1,
            "active": 0,
            "slots": 1,
        }
    )
    new = msgspec.json.decode(old_data, type=WorkerRegistration)
    assert (new.adapters, new.adapters_generation, new.paused) == ({}, 0, False)
