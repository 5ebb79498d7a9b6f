"""The SGLang engine against a recorded fake of SGLang's ``Engine`` API.

SGLang needs a GPU and must not be installed here, so :class:`FakeSglangEngine`
replays the dicts ``Engine.async_generate(..., stream=True)`` yields, recorded
from SGLang's source in ``fixtures/sglang_recorded.json``, and mimics the parts of
``TokenizerManager`` the engine touches: ``abort_request`` ignores rids it no
longer holds, ``rid_to_state`` is filled on the first ``__anext__`` and emptied on
finish or close, unknown keyword arguments are rejected, and a few validation
errors are raised with SGLang's own messages. Prefill and decode fakes meet in a
fake bootstrap server keyed by (host, port, room), so the disaggregated flow only
completes when both sides use the same room.

Only ``test_real_sglang_engine`` touches real SGLang (marked ``gpu``, skipped
when ``import sglang`` fails).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import ContextLengthExceeded, EngineDead, EngineError, InvalidRequest
from shared.protocol import SamplingOptions, TokenLogprob, TopLogprob
from shared.roles import Role
from shared.settings import Settings, WorkerSettings
from workers.engines.base import EngineInfo, StepOutput
from workers.engines.host_address import advertised_host, this_host_address
from workers.engines.sglang import streams as sglang_streams
from workers.engines.sglang.bootstrap import FAKE_BOOTSTRAP_HOST
from workers.engines.sglang.engine import SglangEngine
from workers.engines.sglang.launch import BIND_HOST, SglangLaunchConfig, fit_server_args
from workers.engines.sglang.liveness import pid_alive
from workers.engines.sglang.translate import (
    StreamFormat,
    finish_reason,
    prefill_options,
    sampling_params,
)

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_recorded.json").read_text())
VOCAB = {int(token): text for token, text in FIXTURE["vocab"].items()}
PROMPT: list[int] = FIXTURE["prompt_token_ids"]
STREAMS: dict[str, Any] = FIXTURE["streams"]
HOST, PORT = "10.0.0.5", 8998


# ----------------------------------------------------------------------------- the fake


class FakeTokenizer:
    def batch_decode(self, sequences: list[list[int]]) -> list[str]:
        return ["".join(VOCAB[token] for token in sequence) for sequence in sequences]


@dataclass
class FakeState:
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeTokenizerManager:
    def __init__(self, server_args: SimpleNamespace) -> None:
        self.server_args = server_args
        self.context_len: int = FIXTURE["context_len"]
        self.tokenizer = FakeTokenizer()
        self.rid_to_state: dict[str, FakeState] = {}
        self.abort_calls: list[tuple[str, bool]] = []
        """(rid, whether SGLang still held it, i.e. whether the abort reached the scheduler)."""
        self.handle_loop_started = 0
        self.gracefully_exit = False
        self.ignore_aborts = False

    def auto_create_handle_loop(self) -> None:
        self.handle_loop_started += 1

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        held = rid in self.rid_to_state
        self.abort_calls.append((rid, held))
        if not abort_all and not held:
            return  # TokenizerManager.abort_request: rid already gone
        if not self.ignore_aborts:
            self.rid_to_state[rid].aborted.set()


@dataclass
class FakeBootstrapServer:
    """The prefill engine's bootstrap server: decode registers for a room, prefill sends into it."""

    registered: dict[int, asyncio.Event] = field(default_factory=dict)
    transferred: dict[int, asyncio.Event] = field(default_factory=dict)

    def room(self, room: int) -> tuple[asyncio.Event, asyncio.Event]:
        return (
            self.registered.setdefault(room, asyncio.Event()),
            self.transferred.setdefault(room, asyncio.Event()),
        )


NETWORK: dict[tuple[str, int], FakeBootstrapServer] = {}


class FakeSglangEngine:
    """``sglang.Engine`` as Conveyor's engine sees it: ``async_generate``, ``tokenizer_manager``,
    ``server_args``, ``get_all_child_pids``, ``shutdown``."""

    def __init__(
        self,
        scenario: str = "greedy_stop_token",
        *,
        args: str = "incremental",
        chunk_format: str | None = None,
        host: str = HOST,
    ) -> None:
        self.server_args = SimpleNamespace(**FIXTURE["server_args"][args])
        self.tokenizer_manager = FakeTokenizerManager(self.server_args)
        self.scenario = scenario
        self.chunk_format = chunk_format or (
            "incremental" if args in ("prefill", "decode") else args
        )
        self.next_scenarios: deque[str] = deque()
        self.calls: list[dict[str, Any]] = []
        self.child_pids: list[int] = [os.getpid()]
        self.shutdowns = 0
        self.raise_on_first_chunk: BaseException | None = None
        self.register_delay_s = 0.0
        """Older TokenizerManagers create rid_to_state only after awaiting tokenization."""
        mode = self.server_args.disaggregation_mode
        if mode == "prefill":
            NETWORK[(host, self.server_args.disaggregation_bootstrap_port)] = FakeBootstrapServer()
        self.host = host

    def get_all_child_pids(self) -> list[int]:
        return list(self.child_pids)

    def shutdown(self) -> None:
        self.shutdowns += 1

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        allowed = set(FIXTURE["async_generate_parameters"])
        for name in kwargs:
            if name not in allowed:
                raise TypeError(f"async_generate() got an unexpected keyword argument '{name}'")
        assert kwargs.get("stream") is True, "the engine must stream"
        self.calls.append(copy.deepcopy(kwargs))
        scenario = self.next_scenarios.popleft() if self.next_scenarios else self.scenario
        # Engine.async_generate returns TokenizerManager.generate_request(obj): nothing runs
        # (not even validation) until the first __anext__.
        return self._generate(kwargs, STREAMS[scenario])

    async def _generate(
        self, kwargs: dict[str, Any], recorded: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        if self.raise_on_first_chunk is not None:
            raise self.raise_on_first_chunk
        rid: str = kwargs["rid"]
        _validate(kwargs["sampling_params"], len(kwargs["input_ids"]), self.tokenizer_manager)
        if self.register_delay_s:
            await asyncio.sleep(self.register_delay_s)
        state = self.tokenizer_manager.rid_to_state.setdefault(rid, FakeState())
        try:
            override = await self._disaggregate(kwargs, rid)
            chunks = override if override is not None else recorded.get(self.chunk_format, [])
            for chunk in chunks:
                if state.aborted.is_set():
                    break
                out = _materialize(chunk, rid)
                yield out
                if out["meta_info"]["finish_reason"] is not None:
                    return
                await asyncio.sleep(0)
            if recorded.get("hang") and not state.aborted.is_set():
                await state.aborted.wait()
            if state.aborted.is_set():
                for chunk in recorded.get("on_abort", []):
                    yield _materialize(chunk, rid)
        finally:
            # finish, abort echo, or generate_request's _discard_pending_req_states on close
            self.tokenizer_manager.rid_to_state.pop(rid, None)

    async def _disaggregate(self, kwargs: dict[str, Any], rid: str) -> list[Any] | None:
        mode = self.server_args.disaggregation_mode
        host = kwargs.get("bootstrap_host")
        if mode == "null" or host == FAKE_BOOTSTRAP_HOST:
            return None
        assert host is not None, "a disaggregated request needs a bootstrap host"
        room = kwargs["bootstrap_room"]
        if mode == "prefill":
            assert (host, kwargs["bootstrap_port"]) == (self.host, PORT), "prefill sends to itself"
            registered, transferred = NETWORK[(host, kwargs["bootstrap_port"])].room(room)
            await registered.wait()  # PrefillBootstrapQueue: wait for the decode side
            transferred.set()
            return None
        server = NETWORK.get((host, kwargs["bootstrap_port"]))
        if server is None:
            failed = STREAMS["kv_transfer_failed"]["incremental"]
            return [_replace(chunk, "7", str(room)) for chunk in failed]
        registered, transferred = server.room(room)
        registered.set()
        await transferred.wait()  # DecodeTransferQueue: poll until the KV arrived
        return None


def _validate(params: dict[str, Any], prompt_len: int, manager: FakeTokenizerManager) -> None:
    """What TokenizerManager / SamplingParams check, with their messages."""
    for name in params:
        if name not in FIXTURE["sampling_params_fields"]:
            raise TypeError(f"Unexpected keyword argument '{name}'")
    if not 0.0 < params.get("top_p", 1.0) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params['top_p']}.")
    top_k = params.get("top_k", -1)
    if top_k < 1 and top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    max_new = params.get("max_new_tokens", 128)
    if not params.get("min_new_tokens", 0) <= max_new:
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got "
            f"{params['min_new_tokens']}."
        )
    if prompt_len + max_new > manager.context_len:
        raise ValueError(
            "Requested token count exceeds the model's maximum context length of "
            f"{manager.context_len} tokens. You requested a total of {prompt_len + max_new} "
            f"tokens: {prompt_len} tokens from the input messages and {max_new} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )


def _materialize(chunk: dict[str, Any], rid: str) -> dict[str, Any]:
    return _replace(chunk, "<rid>", rid)


def _replace(chunk: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(chunk).replace(old, new))
    return out


# ----------------------------------------------------------------------------- helpers


INFO = EngineInfo(model="llama", max_model_len=FIXTURE["context_len"], handoff_before_prefill=True)


def make(
    scenario: str = "greedy_stop_token", *, args: str = "incremental", role: Role = Role.AGGREGATED
) -> tuple[SglangEngine, FakeSglangEngine]:
    fake = FakeSglangEngine(scenario, args=args)
    engine = SglangEngine.from_engine(fake, INFO, role=role, bootstrap_host=HOST)
    return engine, fake


async def collect(
    engine: SglangEngine,
    sampling: SamplingOptions | None = None,
    job_id: str = "req-1/0",
    **kw: Any,
) -> list[StepOutput]:
    sampling = sampling or SamplingOptions(max_tokens=16)
    async with asyncio.timeout(5):
        return [step async for step in engine.generate(job_id, PROMPT, sampling, **kw)]


async def until_idle(engine: SglangEngine) -> None:
    """Wait for the aborted streams' pumps; then SGLang holds nothing."""
    async with asyncio.timeout(5):
        if engine._streams._background:
            await asyncio.wait(set(engine._streams._background))
    assert engine.running() == 0


def joined(steps: list[StepOutput]) -> tuple[list[int], str]:
    return [t for s in steps for t in s.token_ids], "".join(s.text for s in steps)


@pytest.fixture(autouse=True)
def _clean_network() -> Iterator[None]:
    NETWORK.clear()
    yield
    NETWORK.clear()


# ----------------------------------------------------------------------------- import


def test_module_imports_without_sglang() -> None:
    code = "import sys, workers.engines.sglang.engine; assert 'sglang' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_constructor_imports_sglang_lazily() -> None:
    with pytest.raises(ModuleNotFoundError, match="sglang"):
        SglangEngine(Settings(), "/models/none", "none")


# ----------------------------------------------------------------------------- request side


EVERY_FIELD = SamplingOptions(
    max_tokens=64,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    seed=1234,
    stop=("\n\n", "END"),
    stop_token_ids=(128001, 128009),
    ignore_eos=True,
    min_tokens=3,
    logprobs=2,
    json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}',
    json_object=True,
    skip_special_tokens=False,
    logit_bias={128009: -100.0, 791: 2.5},
)


def test_sampling_params_every_field() -> None:
    assert sampling_params(EVERY_FIELD) == {
        "max_new_tokens": 64,
        "min_new_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [128001, 128009],
        "json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}',
        "sampling_seed": 1234,
        "logit_bias": {"128009": -100.0, "791": 2.5},  # SGLang keys token ids as strings
    }


def test_sampling_params_defaults() -> None:
    assert sampling_params(SamplingOptions(max_tokens=8)) == {
        "max_new_tokens": 8,
        "min_new_tokens": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,  # Conveyor's 0 = disabled is SGLang's -1
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "ignore_eos": False,
        "skip_special_tokens": True,
    }


def test_json_object_is_an_object_schema() -> None:
    params = sampling_params(SamplingOptions(max_tokens=8, json_object=True))
    assert params["json_schema"] == '{"type": "object"}'


# Where each SamplingOptions field goes; a new field fails here until it is translated.
FIELD_DESTINATIONS = {
    "max_tokens": "sampling_params.max_new_tokens",
    "temperature": "sampling_params.temperature",
    "top_p": "sampling_params.top_p",
    "top_k": "sampling_params.top_k",
    "min_p": "sampling_params.min_p",
    "presence_penalty": "sampling_params.presence_penalty",
    "frequency_penalty": "sampling_params.frequency_penalty",
    "repetition_penalty": "sampling_params.repetition_penalty",
    "seed": "sampling_params.sampling_seed",
    "stop": "sampling_params.stop",
    "stop_token_ids": "sampling_params.stop_token_ids",
    "ignore_eos": "sampling_params.ignore_eos",
    "min_tokens": "sampling_params.min_new_tokens",
    "logprobs": "async_generate.return_logprob/top_logprobs_num",
    "prompt_logprobs": "refused: prompt logprobs are not read from SGLang",
    "json_schema": "sampling_params.json_schema",
    "json_object": "sampling_params.json_schema",
    "skip_special_tokens": "sampling_params.skip_special_tokens",
    "logit_bias": "sampling_params.logit_bias",
    "json_schema_stored": "filled into json_schema by the job queue (no engine field)",
    "regex": "constraint: sampling_params.regex",
    "choice": "refused: no SGLang counterpart",
    "grammar": "constraint: sampling_params.ebnf",
    "structural_tag": "constraint: sampling_params.structural_tag",
    "allowed_token_ids": "refused: no SGLang counterpart",
    "cache_salt": "refused: no SGLang counterpart",
}


@pytest.mark.parametrize(
    ("kind", "value", "destination"),
    [
        ("regex", "[a-z]+", "regex"),
        ("grammar", 'root ::= "yes" | "no"', "ebnf"),
        ("structural_tag", '{"type": "structural_tag"}', "structural_tag"),
    ],
)
def test_constraints_beyond_json(kind: str, value: str, destination: str) -> None:
    params = sampling_params(SamplingOptions(max_tokens=4, **{kind: value}))
    assert params[destination] == value
    assert "json_schema" not in params


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("choice", ("a", "b"), "structured_outputs.choice"),
        ("allowed_token_ids", (1, 2), "allowed_token_ids"),
        ("cache_salt", "tenant-a", "cache_salt"),
        ("prompt_logprobs", 1, "prompt_logprobs"),
    ],
)
def test_fields_without_a_counterpart_are_400(field: str, value: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        sampling_params(SamplingOptions(max_tokens=4, **{field: value}))
    assert caught.value.param == param


def test_every_sampling_option_has_a_destination() -> None:
    names = {f.name for f in msgspec.structs.fields(SamplingOptions)}
    assert names == set(FIELD_DESTINATIONS)
    params = sampling_params(EVERY_FIELD)
    for name, destination in FIELD_DESTINATIONS.items():
        if destination.startswith("sampling_params."):
            assert destination.removeprefix("sampling_params.") in params, name


@settings(max_examples=200, deadline=None)
@given(
    st.builds(
        SamplingOptions,
        max_tokens=st.integers(1, 4096),
        temperature=st.floats(0, 2),
        top_p=st.floats(0.01, 1),
        top_k=st.integers(0, 100),
        min_p=st.floats(0, 1),
        seed=st.none() | st.integers(0, 2**63 - 1),
        stop=st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple),
        stop_token_ids=st.lists(st.integers(0, 200_000), max_size=3).map(tuple),
        min_tokens=st.integers(0, 8),
        json_schema=st.none() | st.just('{"type": "string"}'),
        json_object=st.booleans(),
        logit_bias=st.none() | st.dictionaries(st.integers(0, 200_000), st.floats(-100, 100)),
    )
)
def test_sampling_params_only_uses_sglang_fields(options: SamplingOptions) -> None:
    params = sampling_params(options)
    assert set(params) <= set(FIXTURE["sampling_params_fields"])
    assert params["top_k"] == (options.top_k if options.top_k > 0 else -1)
    assert params["max_new_tokens"] == options.max_tokens
    assert ("sampling_seed" in params) == (options.seed is not None)
    assert params.get("stop", []) == list(options.stop)
    assert params.get("stop_token_ids", []) == list(options.stop_token_ids)
    prefill = sampling_params(prefill_options(options))
    assert prefill["max_new_tokens"] == 1
    assert prefill["min_new_tokens"] == min(options.min_tokens, 1)
    assert {k: v for k, v in prefill.items() if k not in ("max_new_tokens", "min_new_tokens")} == {
        k: v for k, v in params.items() if k not in ("max_new_tokens", "min_new_tokens")
    }


async def test_generate_call_arguments() -> None:
    engine, fake = make()
    await collect(engine, SamplingOptions(max_tokens=16, top_k=0), job_id="req-9/2")
    (call,) = fake.calls
    assert set(call) == {"input_ids", "sampling_params", "stream", "rid"}
    assert call["input_ids"] == PROMPT
    assert call["stream"] is True
    assert call["rid"].startswith("req-9/2#")
    assert call["sampling_params"]["top_k"] == -1


@pytest.mark.parametrize(("k", "top"), [(0, 0), (2, 2), (5, 5)])
async def test_logprobs_request_arguments(k: int, top: int) -> None:
    engine, fake = make("logprobs_top2")
    await collect(engine, SamplingOptions(max_tokens=3, logprobs=k))
    assert fake.calls[0]["return_logprob"] is True
    assert fake.calls[0]["top_logprobs_num"] == top


async def test_rids_are_never_prefixes_of_each_other() -> None:
    """SGLang's scheduler aborts every request whose rid *starts with* the aborted rid."""
    engine, fake = make()
    for job in ("r/1", "r/10", "r/1"):
        await collect(engine, job_id=job)
    rids = [call["rid"] for call in fake.calls]
    assert [rid.split("#")[0] for rid in rids] == ["r/1", "r/10", "r/1"]
    assert len(set(rids)) == 3
    for a in rids:
        for b in rids:
            assert a == b or not b.startswith(a)


async def test_type_error_from_sglang_is_an_engine_error() -> None:
    """E.g. a keyword the installed release lacks (the fake checks the real signature)."""
    engine, fake = make()

    async def bad(**kwargs: Any) -> Any:
        return await FakeSglangEngine.async_generate(fake, **kwargs, return_text_in_logprobs=True)

    fake.async_generate = bad  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="unexpected keyword argument"):
        await collect(engine)


# ----------------------------------------------------------------------------- response side


@pytest.mark.parametrize("fmt", ["incremental", "cumulative", "legacy_stream_output"])
async def test_stream_to_deltas(fmt: str) -> None:
    engine, _ = make("greedy_stop_token", args=fmt)
    steps = await collect(engine)
    recorded = STREAMS["greedy_stop_token"]
    assert joined(steps) == (recorded["expect_ids"], recorded["expect_text"])
    assert [s.token_ids for s in steps] == [[t] for t in recorded["expect_ids"]]
    assert [s.text for s in steps] == [" Paris", ".", " The", " capital", ""]
    assert [s.finish_reason for s in steps] == [None, None, None, None, "stop"]
    assert {s.prompt_tokens for s in steps} == {len(PROMPT)}
    assert all(s.logprobs is None for s in steps)


@pytest.mark.parametrize("scenario", ["greedy_stop_token", "logprobs_top2"])
async def test_incremental_and_cumulative_formats_agree(scenario: str) -> None:
    sampling = SamplingOptions(max_tokens=16, logprobs=2)
    incremental = await collect(make(scenario, args="incremental")[0], sampling)
    cumulative = await collect(make(scenario, args="cumulative")[0], sampling)
    assert incremental == cumulative


async def test_logprobs_with_top_alternatives() -> None:
    engine, _ = make("logprobs_top2")
    steps = await collect(engine, SamplingOptions(max_tokens=3, logprobs=2))
    assert [s.finish_reason for s in steps] == [None, None, "length"]
    assert [lp for s in steps for lp in s.logprobs or []] == [
        TokenLogprob(
            12366,
            " Paris",
            -0.0312,
            [TopLogprob(12366, " Paris", -0.0312), TopLogprob(279, " the", -3.6094)],
        ),
        TokenLogprob(
            13, ".", -0.4187, [TopLogprob(13, ".", -0.4187), TopLogprob(198, "\n", -1.1093)]
        ),
        TokenLogprob(
            578, " The", -1.2025, [TopLogprob(578, " The", -1.2025), TopLogprob(264, " a", -1.3301)]
        ),
    ]


async def test_logprobs_without_alternatives() -> None:
    engine, _ = make("logprobs_top2")
    steps = await collect(engine, SamplingOptions(max_tokens=3, logprobs=0))
    logprobs = [lp for s in steps for lp in s.logprobs or []]
    assert [(lp.token_id, lp.token, lp.top) for lp in logprobs] == [
        (12366, " Paris", []),
        (13, ".", []),
        (578, " The", []),
    ]


async def test_stop_string_is_trimmed_by_sglang() -> None:
    engine, _ = make("stop_string")
    steps = await collect(engine, SamplingOptions(max_tokens=16, stop=(".",)))
    assert joined(steps) == ([12366, 13], " Paris")
    assert steps[-1].finish_reason == "stop"


async def test_empty_chunks_are_skipped() -> None:
    engine, _ = make("idle_tick")
    steps = await collect(engine)
    assert len(steps) == 2
    assert joined(steps) == ([12366, 13], " Paris.")
    assert steps[-1].finish_reason == "length"


def test_stream_format_from_server_args() -> None:
    ns = SimpleNamespace
    assert StreamFormat.of(ns(incremental_streaming_output=True)) == StreamFormat(True, True)
    assert StreamFormat.of(ns(incremental_streaming_output=False)) == StreamFormat(False, False)
    assert StreamFormat.of(ns(stream_output=True)) == StreamFormat(True, False)
    assert StreamFormat.of(ns()) == StreamFormat(False, False)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ({"type": "stop", "matched": 128009}, "stop"),
        ({"type": "stop", "matched": "\n"}, "stop"),
        ({"type": "length", "length": 16}, "length"),
        ({"type": "length", "length": 0}, "length"),
    ],
)
def test_finish_reason_mapping(raw: Any, expected: str | None) -> None:
    assert finish_reason(raw) == expected


def test_abort_finish_reasons() -> None:
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert finish_reason(aborted, abort_requested=True) == "abort"
    rejected = {"type": "abort", "message": "bad grammar", "status_code": 400}
    assert (
        finish_reason(rejected, abort_requested=True) == "abort"
    )  # "Aborted by AbortReq." is a 400
    with pytest.raises(InvalidRequest, match="bad grammar"):
        finish_reason(rejected)
    with pytest.raises(EngineError, match="transfer failed") as info:
        finish_reason({"type": "abort", "message": "transfer failed", "status_code": 500})
    assert not isinstance(info.value, EngineDead)
    with pytest.raises(EngineError, match="Abort in waiting queue"):
        finish_reason({"type": "abort", "message": "Abort in waiting queue"})


# ----------------------------------------------------------------------------- disaggregation


def test_plan_handoff_only_in_prefill_role() -> None:
    prefill, _ = make(args="prefill", role=Role.PREFILL)
    first, second = prefill.plan_handoff("j/0"), prefill.plan_handoff("j/0")
    assert first is not None and second is not None
    assert set(first) == {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
    assert (first["bootstrap_host"], first["bootstrap_port"]) == (HOST, PORT)
    assert 0 <= first["bootstrap_room"] < 2**63
    assert first["bootstrap_room"] != second["bootstrap_room"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(first)) == first  # JSON/msgpack-safe
    assert make(args="decode", role=Role.DECODE)[0].plan_handoff("j/0") is None
    assert make()[0].plan_handoff("j/0") is None
    assert prefill.info.handoff_before_prefill


async def test_bootstrap_room_flow_decode_first() -> None:
    prefill, prefill_fake = make("prefill_done", args="prefill", role=Role.PREFILL)
    decode, decode_fake = make("decode_from_room", args="decode", role=Role.DECODE)
    sampling = SamplingOptions(max_tokens=32, min_tokens=4, temperature=0.6, logprobs=1)

    handoff = prefill.plan_handoff("req-7/0")
    assert handoff is not None
    # the worker queues the decode job first: decode starts and waits in the room
    decoding = asyncio.create_task(collect(decode, sampling, "req-7/0", handoff=handoff))
    await asyncio.sleep(0.01)
    assert not decoding.done()
    async with asyncio.timeout(5):
        result = await prefill.prefill("req-7/0", PROMPT, sampling, handoff=handoff)
        steps = await decoding
    assert result == handoff

    (prefill_call,) = prefill_fake.calls
    (decode_call,) = decode_fake.calls
    for call in (prefill_call, decode_call):
        assert {k: call[k] for k in handoff} == handoff
        assert call["return_logprob"] is True and call["top_logprobs_num"] == 1
    assert prefill_call["sampling_params"]["max_new_tokens"] == 1
    assert prefill_call["sampling_params"]["min_new_tokens"] == 1
    assert prefill_call["sampling_params"]["temperature"] == 0.6
    assert decode_call["sampling_params"] == sampling_params(sampling)
    recorded = STREAMS["decode_from_room"]
    assert joined(steps) == (recorded["expect_ids"], recorded["expect_text"])
    assert steps[-1].finish_reason == "stop"


async def test_prefill_plans_a_room_when_none_is_given() -> None:
    prefill, fake = make("prefill_done", args="prefill", role=Role.PREFILL)
    decode, _ = make("decode_from_room", args="decode", role=Role.DECODE)
    sampling = SamplingOptions(max_tokens=4)
    task = asyncio.create_task(prefill.prefill("j/0", PROMPT, sampling))
    await asyncio.sleep(0.01)
    room = fake.calls[0]["bootstrap_room"]
    async with asyncio.timeout(5):
        await collect(
            decode,
            sampling,
            "j/0",
            handoff={"bootstrap_host": HOST, "bootstrap_port": PORT, "bootstrap_room": room},
        )
        handoff = await task
    assert handoff["bootstrap_room"] == room


async def test_decode_with_unknown_prefill_fails_as_engine_error() -> None:
    decode, _ = make("decode_from_room", args="decode", role=Role.DECODE)
    handoff = {"bootstrap_host": "10.9.9.9", "bootstrap_port": PORT, "bootstrap_room": 7}
    with pytest.raises(EngineError, match="transfer failed") as info:
        await collect(decode, handoff=handoff)
    assert not isinstance(info.value, EngineDead)


async def test_prefill_transfer_failure_raises() -> None:
    prefill, fake = make("kv_transfer_failed", args="prefill", role=Role.PREFILL)
    fake.server_args.disaggregation_mode = "null"  # no decode peer: play the recorded failure
    with pytest.raises(EngineError, match="Decode transfer failed"):
        await prefill.prefill("j/0", PROMPT, SamplingOptions(max_tokens=4))


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_handoffless_generate_uses_fake_transfer(role: str) -> None:
    """The canary's path: Dynamo's disaggregated health check payload."""
    engine, fake = make("greedy_stop_token", args=role, role=Role(role))
    steps = await collect(engine, SamplingOptions(max_tokens=1, temperature=0.0))
    assert steps[-1].finish_reason == "stop"
    call = fake.calls[0]
    assert (call["bootstrap_host"], call["bootstrap_port"], call["bootstrap_room"]) == (
        FAKE_BOOTSTRAP_HOST,
        PORT,
        0,
    )


async def test_handoff_misuse() -> None:
    aggregated, _ = make()
    decode, _ = make(args="decode", role=Role.DECODE)
    good = {"bootstrap_host": HOST, "bootstrap_port": PORT, "bootstrap_room": 1}
    with pytest.raises(EngineError, match="got a KV handoff"):
        await collect(aggregated, handoff=good)
    for bad in (
        {"bootstrap_host": HOST},
        {**good, "bootstrap_room": "1"},
        {**good, "bootstrap_port": True},
    ):
        with pytest.raises(EngineError, match="malformed SGLang handoff"):
            await collect(decode, handoff=bad)
    with pytest.raises(EngineError, match="role 'aggregated'"):
        await aggregated.prefill("j/0", PROMPT, SamplingOptions(max_tokens=1))


# ----------------------------------------------------------------------------- abort


async def _first_steps(
    engine: SglangEngine, job: str, n: int
) -> tuple[asyncio.Task[Any], list[StepOutput]]:
    got: list[StepOutput] = []
    ready = asyncio.Event()

    async def consume() -> list[StepOutput]:
        async for step in engine.generate(job, PROMPT, SamplingOptions(max_tokens=16)):
            got.append(step)
            if len(got) == n:
                ready.set()
        return got

    task = asyncio.create_task(consume())
    if n:
        async with asyncio.timeout(5):
            await ready.wait()
    else:
        await asyncio.sleep(0.01)
    return task, got


async def test_cancelling_the_consumer_aborts_the_rid() -> None:
    engine, fake = make("aborted_while_running")
    task, got = await _first_steps(engine, "req-3/0", 2)
    rid = fake.calls[0]["rid"]
    assert engine.running() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # abort_request reached SGLang while it still held the rid; SGLang then ends the stream
    assert fake.tokenizer_manager.abort_calls == [(rid, True)]
    await until_idle(engine)
    assert joined(got) == ([12366, 13], " Paris.")


async def test_closing_the_stream_early_aborts() -> None:
    engine, fake = make("aborted_while_running")
    stream = engine.generate("req-4/0", PROMPT, SamplingOptions(max_tokens=16))
    async with asyncio.timeout(5):
        first = await anext(stream)
        await stream.aclose()
    assert first.token_ids == [12366]
    assert fake.tokenizer_manager.abort_calls == [(fake.calls[0]["rid"], True)]
    await until_idle(engine)


async def test_abort_is_repeated_until_sglang_holds_the_rid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sglang_streams, "ABORT_RETRY_S", 0.01)
    engine, fake = make("aborted_while_running")
    fake.register_delay_s = 0.05
    task = asyncio.create_task(collect(engine, job_id="req-11/0"))
    await asyncio.sleep(0.01)  # the request is in SGLang's hands, rid not registered yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until_idle(engine)
    rid = fake.calls[0]["rid"]
    calls = fake.tokenizer_manager.abort_calls
    assert calls[0] == (rid, False)  # dropped: SGLang did not hold the rid yet
    assert calls[-1] == (rid, True)  # repeated until it landed
    assert {r for r, _ in calls} == {rid}


async def test_stream_that_ignores_the_abort_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_streams, "ABORT_RETRY_S", 0.01)
    monkeypatch.setattr(sglang_streams, "STREAM_DRAIN_TIMEOUT_S", 0.05)
    engine, fake = make("aborted_while_running")
    fake.tokenizer_manager.ignore_aborts = True
    task, _ = await _first_steps(engine, "req-12/0", 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until_idle(engine)  # closed after the deadline; SGLang dropped the state
    assert len(fake.tokenizer_manager.abort_calls) > 1


async def test_abort_ends_the_stream_with_abort() -> None:
    engine, fake = make("aborted_while_running")
    task, _ = await _first_steps(engine, "req-5/0", 2)
    await engine.abort("req-5/0")
    async with asyncio.timeout(5):
        steps = await task
    assert [s.finish_reason for s in steps] == [None, None, "abort"]
    assert joined(steps) == ([12366, 13, 578], " Paris. The")  # the step in flight still counts
    assert fake.tokenizer_manager.abort_calls == [(fake.calls[0]["rid"], True)]
    assert engine.running() == 0


async def test_abort_in_waiting_queue() -> None:
    engine, _ = make("aborted_in_waiting_queue")
    task, _ = await _first_steps(engine, "req-6/0", 0)
    await engine.abort("req-6/0")
    async with asyncio.timeout(5):
        (step,) = await task
    assert step == StepOutput([], "", None, "abort", len(PROMPT))


async def test_abort_echo_does_not_repeat_text_or_tokens() -> None:
    """_handle_abort_req sends the whole text and the last token again."""
    engine, _ = make("abort_echo_after_tokens")
    task, _ = await _first_steps(engine, "req-8/0", 2)
    await engine.abort("req-8/0")
    async with asyncio.timeout(5):
        steps = await task
    assert joined(steps) == ([12366, 13], " Paris.")
    assert steps[-1] == StepOutput([], "", None, "abort", len(PROMPT), cached_tokens=0)


async def test_abort_of_unknown_or_finished_job_is_a_no_op() -> None:
    engine, fake = make()
    await engine.abort("nobody/0")
    await collect(engine, job_id="done/0")
    await engine.abort("done/0")
    assert fake.tokenizer_manager.abort_calls == []


async def test_finished_stream_is_not_aborted() -> None:
    engine, fake = make()
    await collect(engine)
    assert fake.tokenizer_manager.abort_calls == []
    assert engine.running() == 0


# ----------------------------------------------------------------------------- errors


async def test_context_length_error_is_invalid_request() -> None:
    engine, _ = make()
    with pytest.raises(ContextLengthExceeded, match="maximum context length of 8192"):
        await collect(engine, SamplingOptions(max_tokens=8190))


async def test_sampling_validation_error_is_invalid_request() -> None:
    engine, fake = make()
    with pytest.raises(InvalidRequest, match="top_p must be in"):
        await collect(engine, SamplingOptions(max_tokens=8, top_p=0.0))
    assert fake.tokenizer_manager.abort_calls == []


async def test_rejected_in_band_is_invalid_request() -> None:
    engine, _ = make("grammar_rejected")
    with pytest.raises(InvalidRequest, match="Failed to compile the grammar"):
        await collect(engine, SamplingOptions(max_tokens=8, json_schema='{"type": 1}'))


async def test_engine_failure_while_alive_is_engine_error() -> None:
    engine, fake = make()
    fake.raise_on_first_chunk = RuntimeError("zmq socket closed")
    with pytest.raises(EngineError, match="zmq socket closed") as info:
        await collect(engine)
    assert not isinstance(info.value, EngineDead)
    await engine.check_health()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def test_engine_failure_with_dead_scheduler_is_engine_dead() -> None:
    engine, fake = make()
    fake.child_pids.append(_dead_pid())
    fake.raise_on_first_chunk = RuntimeError("zmq socket closed")
    with pytest.raises(EngineDead):
        await collect(engine)
    with pytest.raises(EngineDead):
        await engine.check_health()


async def test_check_health() -> None:
    engine, fake = make()
    await engine.check_health()
    fake.tokenizer_manager.gracefully_exit = True
    with pytest.raises(EngineDead):
        await engine.check_health()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_zombie_child_counts_as_dead() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.01)
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()
    assert pid_alive(os.getpid())
    assert not pid_alive(proc.pid)


# ----------------------------------------------------------------------------- lifecycle and config


def test_handle_loop_started_on_attach_and_shutdown_once() -> None:
    engine, fake = make()
    assert fake.tokenizer_manager.handle_loop_started == 1
    engine.shutdown()
    engine.shutdown()
    assert fake.shutdowns == 1


@pytest.mark.parametrize(
    ("role", "mode"),
    [(Role.AGGREGATED, "null"), (Role.PREFILL, "prefill"), (Role.DECODE, "decode")],
)
def test_launch_config_from_settings(role: Role, mode: str) -> None:
    config = SglangLaunchConfig.from_settings(
        Settings(role=role, max_model_len=4096, dtype="bfloat16", worker_max_slots=32)
    )
    assert config.disaggregation_mode == mode
    kwargs = config.engine_kwargs("/models/llama", "llama")
    assert kwargs["model_path"] == "/models/llama"
    assert kwargs["served_model_name"] == "llama"
    assert kwargs["context_length"] == 4096
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs["max_running_requests"] == 32
    assert kwargs["incremental_streaming_output"] is True
    assert kwargs["constrained_json_disable_any_whitespace"] is True
    assert kwargs["disaggregation_mode"] == mode
    if mode == "null":
        assert "disaggregation_bootstrap_port" not in kwargs
    else:
        assert kwargs["disaggregation_bootstrap_port"] == 8998
        assert kwargs["disaggregation_transfer_backend"] == "mooncake"
        assert kwargs["host"] == "0.0.0.0"


def test_launch_config_reads_the_sglang_settings() -> None:
    settings = WorkerSettings(
        role=Role.PREFILL,
        max_model_len=None,
        dtype="auto",
        worker_max_slots=8,
        json_any_whitespace=True,
        sglang_bootstrap_port=9100,
        sglang_bootstrap_host="10.1.2.3",
        sglang_transfer_backend="nixl",
        sglang_ib_device="mlx5_0",
        sglang_tp_size=4,
        sglang_mem_fraction_static=0.8,
    )
    config = SglangLaunchConfig.from_settings(settings)
    kwargs = config.engine_kwargs("m", "m")
    assert config.bootstrap_host == "10.1.2.3"
    assert kwargs["disaggregation_bootstrap_port"] == 9100
    assert kwargs["disaggregation_transfer_backend"] == "nixl"
    assert kwargs["disaggregation_ib_device"] == "mlx5_0"
    assert kwargs["tp_size"] == 4
    assert kwargs["mem_fraction_static"] == 0.8
    assert kwargs["constrained_json_disable_any_whitespace"] is False
    assert "context_length" not in kwargs


def test_sglang_settings_defaults_leave_sglang_its_own() -> None:
    kwargs = SglangLaunchConfig.from_settings(WorkerSettings()).engine_kwargs("m", "m")
    assert kwargs["tp_size"] == 1
    assert "mem_fraction_static" not in kwargs
    assert "disaggregation_ib_device" not in kwargs
    assert SglangLaunchConfig.from_settings(WorkerSettings()).bootstrap_host == "auto"


def test_fit_server_args_for_older_sglang() -> None:
    kwargs = SglangLaunchConfig().engine_kwargs("m", "m")
    old = fit_server_args(kwargs, {"model_path", "stream_output"})
    assert old["stream_output"] is True
    assert "incremental_streaming_output" not in old
    assert "constrained_json_disable_any_whitespace" not in old
    new = fit_server_args(
        kwargs, {"incremental_streaming_output", "constrained_json_disable_any_whitespace"}
    )
    assert new == kwargs


def test_bootstrap_host_follows_the_host_address_rule() -> None:
    """The same rule as vLLM's side channel: configured, else a specific bind address,
    else this host's address (tests/unit/test_host_address.py)."""
    assert advertised_host("10.1.2.3", bind_host="192.168.1.7") == "10.1.2.3"
    assert advertised_host("auto", bind_host="192.168.1.7") == "192.168.1.7"
    assert advertised_host("auto", bind_host=BIND_HOST) == this_host_address()


# ----------------------------------------------------------------------------- real SGLang


@pytest.mark.gpu
def test_real_sglang_engine() -> None:
    """Needs sglang, a CUDA GPU and CONVEYOR_TEST_SGLANG_MODEL (a small HF model folder or id)."""
    pytest.importorskip("sglang")
    model = os.environ.get("CONVEYOR_TEST_SGLANG_MODEL")
    if not model:
        pytest.skip("set CONVEYOR_TEST_SGLANG_MODEL to run against real SGLang")

    async def run() -> list[StepOutput]:
        engine = SglangEngine(Settings(max_model_len=2048), model, "test-model")
        try:
            tokens = engine._engine.tokenizer_manager.tokenizer.encode("The capital of France is")
            out = [
                step
                async for step in engine.generate(
                    "gpu/0", tokens, SamplingOptions(max_tokens=8, temperature=0.0, logprobs=2)
                )
            ]
            assert engine.running() == 0
            return out
        finally:
            engine.shutdown()

    steps = asyncio.run(run())
    assert steps[-1].finish_reason in ("stop", "length")
    assert all(len(s.logprobs or []) == len(s.token_ids) for s in steps)
    assert "".join(s.text for s in steps)
