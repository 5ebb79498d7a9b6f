"""The multi-turn workload of the placement benchmark, planned in full from a seed.

A *plan* says, for every conversation, its tenant, when it starts, and for every turn
the user's words, the think time after the answer, and whether the history starts over
before it. Three kinds:

* ``multi-turn``: S conversations of T turns; each opens with its tenant's system
  prompt (one per tenant, shared by that tenant's conversations) and keeps its whole
  history: the assistant's answers are appended, as a chat client does.
* ``control``: the same number of turns and prompt lengths, but every turn is a fresh
  conversation with a system prompt of its own: no two prompts share a prefix.
* ``skew``: as ``multi-turn``, but a quarter of the conversations send 80 % of the turns.

Conversations start together (a closed load: a slower server gets fewer requests), or,
with ``arrival_rate``, one after another at Poisson times (an open load, as a trace
replays or new users arrive: a server slower than the arrivals falls behind).

A conversation whose next turn would pass ``max_context_tokens`` starts over (a new chat
of the same tenant), so long skewed conversations stay inside the model's context.

Words are indexes into a list of one-token words (see :class:`bench.prompts.PromptFactory`),
so the plan needs no tokenizer; :func:`words_text` spells them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["multi-turn", "control", "skew"]
KINDS: tuple[Kind, ...] = ("multi-turn", "control", "skew")
HEAVY_SHARE = 0.25
"""Skew: this share of the conversations ..."""
HEAVY_TURNS = 0.8
"""... sends this share of the turns."""
TURN_OVERHEAD_TOKENS = 12
"""Chat-template tokens around one user message and one answer (ChatML: ~5 each)."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: Kind = "multi-turn"
    conversations: int = 16
    turns: int = 6
    """Turns per conversation (skew: the average; the total stays conversations x turns)."""
    tenants: int = 4
    system_tokens: int = 1000
    user_tokens: tuple[int, int] = (100, 300)
    output_tokens: int = 64
    think_s: tuple[float, float] = (0.5, 2.0)
    max_context_tokens: int = 6000
    arrival_rate: float = 0.0
    """Conversations that start per second, at Poisson times (an open load: new chats keep
    arriving however slowly the server answers); 0: every conversation starts within the
    first think time (a closed load)."""
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Turn:
    system: int
    """Which system prompt opens the history (a tenant's, or one of its own: control)."""
    fresh: bool
    """The history starts over before this turn (the first turn, a new chat, control)."""
    user_words: tuple[int, ...]
    think_s: float
    """The pause after this turn's answer, before the next turn."""


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    number: int
    tenant: int
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    spec: WorkloadSpec
    conversations: tuple[ConversationPlan, ...]
    systems: dict[int, tuple[int, ...]]
    """System prompt number -> its words."""

    @property
    def total_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def working_set_tokens(self, turn_s: float = 0.0) -> int:
        """Tokens a cache must hold for every live conversation's full history at once:
        each distinct system prompt once, plus the longest history of every conversation
        live at the busiest moment. In a closed load every conversation is live; in an
        open one a conversation lives from its start through its think times and its
        turns, each taking at least ``turn_s`` (0: count every conversation)."""
        systems = sum(len(words) for words in self.systems.values())
        if self.spec.arrival_rate <= 0 or turn_s <= 0:
            return systems + sum(_longest_history(c, self.spec) for c in self.conversations)
        return systems + self._peak_live_history(turn_s)

    def _peak_live_history(self, turn_s: float) -> int:
        changes: list[tuple[float, int]] = []
        for conversation in self.conversations:
            history = _longest_history(conversation, self.spec)
            span = sum(turn.think_s for turn in conversation.turns)
            span += len(conversation.turns) * turn_s
            changes.append((conversation.start_s, history))
            changes.append((conversation.start_s + span, -history))
        peak = current = 0
        for _, change in sorted(changes):
            current += change
            peak = max(peak, current)
        return peak


def turn_counts(spec: WorkloadSpec) -> list[int]:
    """Turns per conversation: ``turns`` each, or (skew) a quarter sends 80 % of them."""
    if spec.kind != "skew":
        return [spec.turns] * spec.conversations
    total = spec.conversations * spec.turns
    heavy = max(1, round(spec.conversations * HEAVY_SHARE))
    light = spec.conversations - heavy
    heavy_turns = round(total * HEAVY_TURNS) if light else total
    counts = _spread(heavy_turns, heavy) + _spread(total - heavy_turns, light)
    return [max(1, count) for count in counts]


def _spread(total: int, parts: int) -> list[int]:
    size, extra = divmod(total, parts) if parts else (0, 0)
    return [size + (1 if index < extra else 0) for index in range(parts)]


def make_plan(spec: WorkloadSpec, vocabulary: int) -> Plan:
    """The whole workload for ``spec``: the same spec and vocabulary size, the same plan."""
    rng = random.Random(f"conveyor-placement-{spec.seed}")
    systems = {
        tenant: _words(rng, spec.system_tokens, vocabulary) for tenant in range(spec.tenants)
    }
    conversations = []
    arrivals = random.Random(f"conveyor-arrivals-{spec.seed}")
    arrived = 0.0
    for number, count in enumerate(turn_counts(spec)):
        tenant = number % spec.tenants
        start_s = rng.uniform(0.0, spec.think_s[1])  # drawn either way: the same turns follow
        if spec.arrival_rate > 0:
            start_s = arrived
            arrived += arrivals.expovariate(spec.arrival_rate)
        turns: list[Turn] = []
        context = 0
        for _ in range(count):
            user = _words(rng, rng.randint(*spec.user_tokens), vocabulary)
            think = rng.uniform(*spec.think_s)
            cost = len(user) + spec.output_tokens + TURN_OVERHEAD_TOKENS
            system = tenant
            if spec.kind == "control":
                system = len(systems)
                systems[system] = _words(rng, spec.system_tokens, vocabulary)
            fresh = spec.kind == "control" or not turns or context + cost > spec.max_context_tokens
            if fresh:
                context = spec.system_tokens + TURN_OVERHEAD_TOKENS
            context += cost
            turns.append(Turn(system, fresh, user, think))
        conversations.append(ConversationPlan(number, tenant, start_s, tuple(turns)))
    return Plan(spec, tuple(conversations), systems)


def _words(rng: random.Random, count: int, vocabulary: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocabulary) for _ in range(count))


def _longest_history(conversation: ConversationPlan, spec: WorkloadSpec) -> int:
    longest = current = 0
    for turn in conversation.turns:
        if turn.fresh:
            current = TURN_OVERHEAD_TOKENS
        current += len(turn.user_words) + spec.output_tokens + TURN_OVERHEAD_TOKENS
        longest = max(longest, current)
    return longest


def words_text(words: Sequence[str], indexes: Sequence[int]) -> str:
    """The text of ``indexes`` into ``words`` (each word carries its leading space)."""
    return "".join(words[index] for index in indexes).lstrip()


def ideal_cached_tokens(prompts: Sequence[Sequence[int]], block_tokens: int) -> list[int]:
    """Per prompt, in the order sent, the tokens one infinite prefix cache would have
    served: the longest run of whole blocks that starts an earlier prompt too. As in
    vLLM, the last token of a prompt is always computed, so it never counts. (An engine
    also caches the blocks it generates, so a cache may serve a little more than this
    when an answer re-tokenizes as it was generated.)"""
    seen: set[int] = set()
    cached: list[int] = []
    for prompt in prompts:
        chain = _block_chain(prompt, block_tokens)
        usable = (len(prompt) - 1) // block_tokens
        hit = 0
        while hit < usable and chain[hit] in seen:
            hit += 1
        cached.append(hit * block_tokens)
        seen.update(chain)
    return cached


def _block_chain(prompt: Sequence[int], block_tokens: int) -> list[int]:
    """Each whole block's key, chained over every block before it (as engines hash)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(prompt) // block_tokens * block_tokens, block_tokens):
        parent = hash((parent, tuple(prompt[start : start + block_tokens])))
        keys.append(parent)
    return keys
