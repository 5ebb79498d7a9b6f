"""The placement benchmark's workload generator (bench/conversations.py): deterministic
plans, growing histories, the skew, and the ideal cache ratio."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from bench.chat_load import Message, TurnResult, _converse
from bench.conversations import (
    WorkloadSpec,
    ideal_cached_tokens,
    make_plan,
    turn_counts,
)

VOCABULARY = 500


def test_the_same_seed_gives_the_same_plan_and_another_seed_another() -> None:
    spec = WorkloadSpec(conversations=6, turns=4, seed=3)
    assert make_plan(spec, VOCABULARY) == make_plan(spec, VOCABULARY)
    other = make_plan(dataclasses.replace(spec, seed=4), VOCABULARY)
    assert other.conversations != make_plan(spec, VOCABULARY).conversations


def test_an_arrival_rate_starts_conversations_one_after_another_at_that_rate() -> None:
    """An open load: Poisson starts, the first at once, a mean gap of 1 / rate; the turns
    are those of the closed plan with the same seed."""
    closed = WorkloadSpec(conversations=2000, turns=2, seed=5)
    plan = make_plan(dataclasses.replace(closed, arrival_rate=4.0), VOCABULARY)
    starts = [c.start_s for c in plan.conversations]
    assert starts[0] == 0.0
    assert starts == sorted(starts)
    assert 0.23 < starts[-1] / (len(starts) - 1) < 0.27
    same_turns = [c.turns for c in make_plan(closed, VOCABULARY).conversations]
    assert [c.turns for c in plan.conversations] == same_turns


def test_an_open_load_sizes_its_working_set_from_the_conversations_live_at_once() -> None:
    """Closed: every conversation counts. Open: only those live at the busiest moment,
    so a slow arrival rate or short conversations need less cache."""
    closed = WorkloadSpec(conversations=400, turns=3, seed=2)
    everything = make_plan(closed, VOCABULARY).working_set_tokens()
    assert make_plan(closed, VOCABULARY).working_set_tokens(turn_s=1.0) == everything
    open_plan = make_plan(dataclasses.replace(closed, arrival_rate=2.0), VOCABULARY)
    assert open_plan.working_set_tokens() == everything
    live = open_plan.working_set_tokens(turn_s=1.0)
    assert live < everything / 5
    assert open_plan.working_set_tokens(turn_s=0.1) < live < open_plan.working_set_tokens(5.0)
    systems = sum(len(words) for words in open_plan.systems.values())
    # 2 starts/s x (3 x 1.25 s of think time + 3 x 1 s of turns): about 13.5 live at once
    per_conversation = (everything - systems) / 400
    assert 8 < (live - systems) / per_conversation < 25


def test_conversations_share_their_tenants_system_prompt_and_keep_their_history() -> None:
    spec = WorkloadSpec(conversations=8, turns=5, tenants=2, user_tokens=(100, 300))
    plan = make_plan(spec, VOCABULARY)
    assert len(plan.systems) == 2
    for conversation in plan.conversations:
        assert conversation.tenant == conversation.number % 2
        assert [t.fresh for t in conversation.turns] == [True, False, False, False, False]
        assert {t.system for t in conversation.turns} == {conversation.tenant}
        assert all(100 <= len(t.user_words) <= 300 for t in conversation.turns)
        assert all(0.5 <= t.think_s <= 2.0 for t in conversation.turns)
    assert plan.total_turns == 40


def test_the_history_grows_with_every_answer() -> None:
    """Turn k sends the system prompt, k user messages and k - 1 answers, in order (no
    think time: the plan's pauses are all 0 s)."""
    spec = WorkloadSpec(conversations=1, turns=4, think_s=(0.0, 0.0), output_tokens=2)
    plan = make_plan(spec, VOCABULARY)
    words = [f" w{i}" for i in range(VOCABULARY)]
    sent: list[list[Message]] = []

    async def answer(_client: object, _model: str, _tokens: int, result: TurnResult) -> None:
        sent.append(result.messages)
        result.text = f"answer {len(sent)}"

    results: list[TurnResult] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("bench.chat_load.send_turn", answer)
        asyncio.run(_converse(None, "m", plan, plan.conversations[0], words, results))  # type: ignore[arg-type]
    assert [len(m) for m in sent] == [2, 4, 6, 8]
    for earlier, later in itertools.pairwise(sent):
        assert later[: len(earlier)] == earlier  # the prefix never changes
    assert sent[-1][0]["role"] == "system"
    assert [m["content"] for m in sent[-1] if m["role"] == "assistant"] == [
        "answer 1",
        "answer 2",
        "answer 3",
    ]


def test_skew_sends_80_percent_of_the_turns_from_a_quarter_of_the_conversations() -> None:
    spec = WorkloadSpec(kind="skew", conversations=16, turns=6)
    counts = turn_counts(spec)
    assert sum(counts) == 96
    heavy = sorted(counts, reverse=True)[:4]
    assert sum(heavy) / sum(counts) == pytest.approx(0.8, abs=0.01)
    assert min(counts) >= 1
    plan = make_plan(spec, VOCABULARY)
    assert plan.total_turns == 96


def test_a_history_longer_than_the_context_starts_a_new_chat() -> None:
    spec = WorkloadSpec(
        kind="skew", conversations=4, turns=10, system_tokens=100, max_context_tokens=1500
    )
    for conversation in make_plan(spec, VOCABULARY).conversations:
        context = 0
        for turn in conversation.turns:
            cost = len(turn.user_words) + spec.output_tokens + 12
            context = (spec.system_tokens + 12 if turn.fresh else context) + cost
            assert context <= spec.max_context_tokens


def test_control_prompts_share_no_system_prompt() -> None:
    plan = make_plan(WorkloadSpec(kind="control", conversations=3, turns=4), VOCABULARY)
    systems = [t.system for c in plan.conversations for t in c.turns]
    assert len(set(systems)) == 12
    assert all(t.fresh for c in plan.conversations for t in c.turns)


def test_ideal_counts_whole_blocks_already_seen_never_the_last_token() -> None:
    first = list(range(40))
    extends = [*first, 100, 101, 102]  # 43 tokens: the 40 of `first` start it
    exactly = list(range(32))  # all cached but the last token: only 16 count
    other = [7, *range(1, 40)]
    assert ideal_cached_tokens([first, extends, exactly, other], 16) == [0, 32, 16, 0]


def test_ideal_ratio_of_a_shared_prefix() -> None:
    system = list(range(1000, 1064))  # 4 blocks shared by every prompt
    prompts = [[*system, *range(i * 100, i * 100 + 30)] for i in range(5)]
    cached = ideal_cached_tokens(prompts, 16)
    assert cached == [0, 64, 64, 64, 64]
    assert sum(cached) / sum(len(p) for p in prompts) == pytest.approx(256 / 470)
