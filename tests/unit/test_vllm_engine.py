"""The vLLM engine's translation, against vLLM's own classes (workers/engines/vllm/engine.py):
SamplingOptions -> SamplingParams, job prompt + images -> TokensPrompt, RequestOutput ->
StepOutput, every vLLM exception -> the Conveyor error tree, and vLLM's KV events -> the
ones workers forward to Redis. No engine starts; this is the one test module that imports
vllm (about 10 s)."""

from __future__ import annotations

import inspect
import json
import math

import msgspec
import pytest
import torch
import vllm.exceptions
import vllm.v1.engine.exceptions
from PIL import Image
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.exceptions import VLLMClientError, VLLMError
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from shared.errors import ConveyorError, EngineDead, EngineError, InvalidRequest
from shared.protocol import PromptLogprob, SamplingOptions, TokenLogprob, TopLogprob
from shared.queue.kv_events import ClearedBlocks, RemovedBlocks, StoredBlocks
from workers.engines.base import PromptImages, StepOutput
from workers.engines.vision.encoder import ImageEmbedding
from workers.engines.vllm.kv_events import engine_hash, translate
from workers.engines.vllm.translate import (
    sampling_params,
    step_output,
    tokens_prompt,
    vllm_errors,
)

# ------------------------------------------------------------------ SamplingParams

EVERY_FIELD = SamplingOptions(
    max_tokens=17,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    presence_penalty=0.25,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    seed=1234,
    stop=("END", "\n\n"),
    stop_token_ids=(2, 3),
    ignore_eos=True,
    min_tokens=4,
    logprobs=3,
    prompt_logprobs=2,
    skip_special_tokens=False,
    logit_bias={5: 10.0, 6: -100.0},
    allowed_token_ids=(5, 6, 7),
)


def test_every_sampling_option_reaches_sampling_params() -> None:
    params = sampling_params(EVERY_FIELD)
    assert isinstance(params, SamplingParams)
    assert params.n == 1
    assert params.output_kind is RequestOutputKind.DELTA
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "ignore_eos", "min_tokens",
                 "logprobs", "prompt_logprobs", "skip_special_tokens", "logit_bias"):  # fmt: skip
        assert getattr(params, name) == getattr(EVERY_FIELD, name), name
    assert params.stop == ["END", "\n\n"]
    assert params.stop_token_ids == [2, 3]
    assert params.allowed_token_ids == [5, 6, 7]
    assert params.structured_outputs is None
    assert params.extra_args is None


def test_defaults_ask_vllm_for_nothing_special() -> None:
    params = sampling_params(SamplingOptions(max_tokens=3))
    assert (params.stop, params.stop_token_ids, params.logprobs) == ([], [], None)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert params.logit_bias is None


def test_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_schema = sampling_params(SamplingOptions(max_tokens=3, json_schema=json.dumps(schema)))
    assert by_schema.structured_outputs.json == schema
    any_json = sampling_params(SamplingOptions(max_tokens=3, json_object=True))
    assert any_json.structured_outputs.json_object is True


TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "<ok>"}})


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("regex", r"\d{3}-[a-z]+"),
        ("grammar", 'root ::= "yes" | "no"'),
        ("grammar", 'start: "yes" | "no"'),
        ("structural_tag", TAG),
    ],
)
def test_constraints_beyond_json(kind: str, value: str) -> None:
    params = sampling_params(SamplingOptions(max_tokens=3, **{kind: value}))
    assert getattr(params.structured_outputs, kind) == value


def test_choice_is_checked_as_vllm_does_it_a_grammar() -> None:
    params = sampling_params(SamplingOptions(max_tokens=3, choice=("yes", "no")))
    structured = params.structured_outputs
    assert structured.choice is None  # vLLM's own check rewrites choices as a grammar
    assert "yes" in structured.grammar


@pytest.mark.parametrize(
    ("kind", "value", "param"),
    [
        ("regex", "(unclosed", "structured_outputs.regex"),
        ("grammar", "root ::= ", "structured_outputs.grammar"),
        ("grammar", "this is not a grammar", "structured_outputs.grammar"),
        ("structural_tag", '{"type": "nonsense"}', "structured_outputs.structural_tag"),
        ("json_schema", '{"type": "integer", "minimum": "x"}', None),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    kind: str, value: str, param: str | None
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        sampling_params(SamplingOptions(max_tokens=3, **{kind: value}))
    assert (caught.value.status, caught.value.param) == (400, param)


def test_kv_transfer_params_ride_in_extra_args() -> None:
    handoff = {"do_remote_decode": True}
    params = sampling_params(SamplingOptions(max_tokens=1), kv_transfer_params=handoff)
    assert params.extra_args == {"kv_transfer_params": handoff}


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 0.0), ("temperature", -1.0), ("max_tokens", 0), ("top_k", -5), ("min_p", 2.0)],
)
def test_values_vllm_refuses_are_the_requests_fault(field: str, value: float) -> None:
    options = SamplingOptions(**{"max_tokens": 3, field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="invalid sampling parameters") as caught:
        sampling_params(options)
    assert caught.value.status == 400


# --------------------------------------------------------------------- TokensPrompt


def test_a_text_prompt_is_its_token_ids() -> None:
    assert tokens_prompt([1, 2, 3], None, None) == {"prompt_token_ids": [1, 2, 3]}


def test_a_cache_salt_rides_on_the_prompt() -> None:
    prompt = tokens_prompt([1, 2], None, None, "tenant-a")
    assert prompt == {"prompt_token_ids": [1, 2], "cache_salt": "tenant-a"}


def test_raw_images_go_along_decoded() -> None:
    image = Image.new("RGB", (4, 4))
    prompt = tokens_prompt([1, 99, 2], PromptImages(raw=(image,)), "llava")
    assert prompt["prompt_token_ids"] == [1, 99, 2]  # one unexpanded placeholder: vLLM expands
    assert prompt["multi_modal_data"] == {"image": [image]}


def test_an_encode_workers_embeddings_go_in_the_familys_shape() -> None:
    first, second = torch.zeros(3, 8), torch.ones(5, 8)
    embeddings = (ImageEmbedding(first, (1, 6, 2)), ImageEmbedding(second, (1, 10, 2)))
    llava = tokens_prompt([1, 99, 99], PromptImages(embeddings=embeddings), "llava")
    assert [t.shape for t in llava["multi_modal_data"]["image"]] == [(3, 8), (5, 8)]
    qwen = tokens_prompt([1, 99, 99], PromptImages(embeddings=embeddings), "qwen2_vl")
    image = qwen["multi_modal_data"]["image"]
    assert image["image_embeds"].shape == (8, 8)
    assert image["image_grid_thw"].tolist() == [[1, 6, 2], [1, 10, 2]]


def test_images_for_a_text_only_model_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="does not take images"):
        tokens_prompt([1], PromptImages(raw=(Image.new("RGB", (4, 4)),)), None)


# ----------------------------------------------------------------------- StepOutput


def request_output(
    token_ids: list[int],
    text: str,
    *,
    logprobs: list[dict[int, Logprob]] | None = None,
    finish_reason: str | None = None,
    prompt_token_ids: list[int] | None = None,
    num_cached_tokens: int | None = None,
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=finish_reason,
    )
    return RequestOutput(
        request_id="job-1",
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=[completion],
        finished=finish_reason is not None,
        num_cached_tokens=num_cached_tokens,
    )


def test_a_delta_becomes_a_step_output() -> None:
    output = request_output([11, 12], " hi", prompt_token_ids=[1, 2, 3, 4])
    assert step_output(output, [1, 2, 3], None) == StepOutput(
        token_ids=[11, 12], text=" hi", logprobs=None, finish_reason=None, prompt_tokens=4
    )


def test_prefix_cache_hits_are_carried_as_cached_tokens() -> None:
    output = request_output([], "", finish_reason="stop", num_cached_tokens=128)
    assert step_output(output, [1, 2, 3], None).cached_tokens == 128
    assert step_output(request_output([5], "x"), [1], None).cached_tokens is None


def test_the_last_delta_carries_the_finish_reason() -> None:
    output = request_output([], "", finish_reason="stop")
    finished = step_output(output, [1, 2, 3], None)
    assert (finished.finish_reason, finished.token_ids, finished.text) == ("stop", [], "")
    assert finished.prompt_tokens == 3  # vLLM sent no prompt ids: the job's count


def test_logprobs_keep_the_top_k_by_rank_and_clamp_minus_infinity() -> None:
    alternatives = {
        11: Logprob(-0.5, rank=2, decoded_token=" hi"),  # sampled, though not the best
        12: Logprob(-0.1, rank=1, decoded_token=" ho"),
        13: Logprob(-3.0, rank=3, decoded_token=" ha"),
        14: Logprob(-math.inf, rank=4, decoded_token=" hu"),
    }
    output = request_output([11], " hi", logprobs=[alternatives])
    assert step_output(output, [1], 2).logprobs == [
        TokenLogprob(11, " hi", -0.5, [TopLogprob(12, " ho", -0.1), TopLogprob(11, " hi", -0.5)])
    ]
    ruled_out = request_output([14], " hu", logprobs=[alternatives])
    [logprob] = step_output(ruled_out, [1], 0).logprobs or []
    assert (logprob.logprob, logprob.top) == (-9999.0, [])  # -inf is not JSON


def test_prompt_logprobs_keep_the_prompt_token_first_and_the_ranks() -> None:
    scored = [
        None,
        {5: Logprob(-2.5, rank=7, decoded_token=" b"), 9: Logprob(-0.1, 1, " z")},
        {6: Logprob(-math.inf, rank=3, decoded_token="c")},
    ]
    output = request_output([11], " hi", prompt_token_ids=[4, 5, 6], prompt_logprobs=scored)
    step = step_output(output, [4, 5, 6], None)
    assert step.prompt_logprobs == [
        None,
        [PromptLogprob(5, " b", -2.5, 7), PromptLogprob(9, " z", -0.1, 1)],
        [PromptLogprob(6, "c", -9999.0, 3)],
    ]
    assert step_output(request_output([11], " hi"), [4], None).prompt_logprobs is None


def test_no_logprobs_unless_the_request_asked() -> None:
    output = request_output([11], " hi", logprobs=[{11: Logprob(-0.5, 1, " hi")}])
    assert step_output(output, [1], None).logprobs is None


# ------------------------------------------------------------------------ exceptions

VLLM_ERRORS = [
    cls
    for module in (vllm.exceptions, vllm.v1.engine.exceptions)
    for _, cls in inspect.getmembers(module, inspect.isclass)
    if issubclass(cls, VLLMError) and cls.__module__ == module.__name__
]


def instance(cls: type[VLLMError]) -> VLLMError:
    """An instance, whatever the constructor wants (a string for each required argument)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except ValueError:  # no __init__ of its own: Exception's
        return cls("bad request")
    required = [
        p
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return cls(*(f"bad {p.name}" for p in required))


@pytest.mark.parametrize("cls", VLLM_ERRORS, ids=lambda cls: cls.__name__)
def test_every_vllm_error_becomes_a_conveyor_error(cls: type[VLLMError]) -> None:
    raised = instance(cls)
    with pytest.raises(ConveyorError) as caught, vllm_errors("generation", param="p"):
        raise raised
    assert caught.value.__cause__ is raised
    if issubclass(cls, EngineDeadError):
        assert isinstance(caught.value, EngineDead)
    elif issubclass(cls, VLLMClientError):
        assert type(caught.value) is InvalidRequest
        assert (caught.value.status, caught.value.param) == (400, "p")
    else:
        assert type(caught.value) is EngineError
        assert caught.value.status == 500


def test_a_bare_value_error_is_not_the_clients_fault() -> None:
    with pytest.raises(ValueError, match="bug") as caught, vllm_errors("generation"):
        raise ValueError("bug in an adapter")
    assert not isinstance(caught.value, ConveyorError)


# ------------------------------------------------------------------ KV events

KV_TOKENS = list(range(8))


def kv_stored(**fields: object) -> BlockStored:
    values: dict[str, object] = {
        "block_hashes": [b"\x01" * 32, b"\x02" * 32],
        "parent_block_hash": None,
        "token_ids": KV_TOKENS,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **fields,
    }
    return BlockStored(**values)  # type: ignore[arg-type]


def over_the_wire(*events: object) -> list[object]:
    """As the worker receives them: msgpack from vLLM's publisher, decoded."""
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))  # type: ignore[arg-type]
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    return list(batch.events)


def test_stored_removed_cleared() -> None:
    events = over_the_wire(
        kv_stored(lora_name="sql", parent_block_hash=7),
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"),
        AllBlocksCleared(),
    )
    first = engine_hash(b"\x01" * 32)
    assert first == int.from_bytes(b"\x01" * 8, "big")
    assert translate(events) == [
        StoredBlocks([first, engine_hash(b"\x02" * 32)], 7, KV_TOKENS, "sql"),
        RemovedBlocks([first]),
        ClearedBlocks(),
    ]


def test_blocks_keyed_by_more_than_tokens_are_left_out() -> None:
    salted = kv_stored(extra_keys=[None, ("salt",)])  # the second block has a cache_salt
    adapter = kv_stored(lora_name="sql", extra_keys=[("sql",), ("sql",)])
    image = kv_stored(extra_keys=[(("mm-hash", 0),), None])
    assert [len(e.engine_hashes) for e in translate(over_the_wire(salted, adapter))] == [1, 2]  # type: ignore[union-attr]
    assert translate(over_the_wire(image)) == []


def test_other_media_and_groups_are_left_out() -> None:
    offloaded = kv_stored(medium="CPU")
    second_group = kv_stored(group_idx=1)
    removed = BlockRemoved(block_hashes=[5], medium="STORAGE")
    assert translate(over_the_wire(offloaded, second_group, removed)) == []
