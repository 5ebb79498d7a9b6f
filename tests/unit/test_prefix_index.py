"""Block names, the prefix index and the cache-aware placer, in process."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.placement.cache_placer import CachePlacer, CostPolicy
from gateway.placement.placer import Candidate, PlacementReason, PlacementRequest
from gateway.placement.prefix_index import PrefixIndex
from shared.block_hashes import (
    COMPILED,
    EngineBlockMap,
    block_names,
    chain_names,
    chain_seed,
    new_holders,
    python_chain_names,
    python_walk_chain,
    walk_chain,
)
from shared.queue.kv_events import (
    ClearedBlocks,
    KvBatch,
    KvEvent,
    KvSnapshot,
    PendingBlocks,
    RemovedBlocks,
    StoredBlocks,
)
from shared.roles import Role

SIZE = 4
MODEL = "m"


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def stored(
    token_ids: list[int], *, first: int = 0, parent: int | None = None, lora: str | None = None
) -> StoredBlocks:
    """Blocks of ``token_ids`` with engine hashes first, first+1, ... (the engine's own)."""
    count = len(token_ids) // SIZE
    return StoredBlocks(list(range(first, first + count)), parent, token_ids, lora)


class Feed:
    """Numbers each worker's batches as a worker's forwarder does."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.seq: dict[str, int] = {}

    def send(self, worker_id: str, *events: KvEvent, model: str = MODEL) -> bool:
        seq = self.seq.get(worker_id, -1) + 1
        self.seq[worker_id] = seq
        return self.index.apply(KvBatch(worker_id, model, SIZE, seq, list(events)))


def candidate(
    worker_id: str,
    *,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.1,
    queued: int = 0,
    adapters: frozenset[str] = frozenset(),
    free_slots: int = 8,
) -> Candidate:
    return Candidate(worker_id, running, waiting, free_slots, kv, queued, adapters)


def request(
    token_ids: list[int] | None, *, lora: str | None = None, cache_key: str | None = None
) -> PlacementRequest:
    return PlacementRequest(MODEL, Role.AGGREGATED, lora, token_ids, cache_key)


# ---------------------------------------------------------------------- names


def test_same_tokens_same_names_and_chained() -> None:
    seed = chain_seed(MODEL, None)
    a = block_names(tokens(16), SIZE, seed)
    assert a == block_names(tokens(16), SIZE, seed)
    assert len(a) == 4
    changed = tokens(16)
    changed[1] += 1  # the first block differs: every later name differs too
    assert not set(a) & set(block_names(changed, SIZE, seed))


@pytest.mark.parametrize(("size", "count"), [(4, 3), (16, 2), (1, 1500)])
def test_names_are_the_chained_tuple_hashes(size: int, count: int) -> None:
    """The definition workers and gateways share, at any block size and prompt length."""
    token_ids = tokens(count * size + size - 1)
    name = chain_seed(MODEL, None)
    expected = []
    for block in range(count):
        name = hash((name, tuple(token_ids[block * size : (block + 1) * size])))
        expected.append(name)
    assert block_names(token_ids, size, chain_seed(MODEL, None)) == expected


def test_names_are_computed_by_the_compiled_extension() -> None:
    """The Python reference serves only where shared/_chain.c could not be built; this
    install must have built it (``make install`` with a C compiler)."""
    assert COMPILED


@given(
    st.lists(st.integers(-(2**70), 2**70), max_size=200),
    st.sampled_from([1, 2, 3, 16]),
    st.integers(-(2**63), 2**63 - 1),
    st.data(),
)
def test_compiled_names_equal_the_reference(
    token_ids: list[int], size: int, seed: int, data: st.DataObject
) -> None:
    full = len(token_ids) // size
    start = data.draw(st.integers(0, full))
    count = data.draw(st.integers(0, full - start))
    expected = python_chain_names(token_ids, size, start, count, seed)
    assert chain_names(token_ids, size, start, count, seed) == expected
    assert chain_names(tuple(token_ids), size, start, count, seed) == expected
    if start:  # continued from the name before ``start``: the chain's own names
        whole = block_names(token_ids, size, seed)
        continued = chain_names(token_ids, size, start, count, whole[start - 1])
        assert continued == whole[start : start + count]


@given(
    st.lists(st.integers(0, 50), max_size=120),
    st.sampled_from([1, 4]),
    st.lists(st.integers(0, (1 << 70) - 1), max_size=40),
    st.integers(0, (1 << 70) - 1),
)
def test_the_compiled_walk_equals_the_reference(
    token_ids: list[int], size: int, masks: list[int], held: int
) -> None:
    """Holders of the chain's own names (so walks go deep) with random masks, some wider
    than 64 bits (the compiled walk meets a held mask of at most 64 bits)."""
    count = len(token_ids) // size
    seed = chain_seed(MODEL, None)
    names = python_chain_names(token_ids, size, 0, count, seed)
    holders = dict(zip(names, masks, strict=False))
    table = new_holders()
    for name, mask in holders.items():
        if mask:  # a held block's mask is positive; a 0 is a block not held
            table[name] = mask
    for mask_of_held in (held, held & (2**64 - 1)):
        expected = python_walk_chain(token_ids, size, count, seed, holders, mask_of_held)
        assert walk_chain(token_ids, size, count, seed, holders, mask_of_held) == expected
        assert walk_chain(token_ids, size, count, seed, table, mask_of_held) == expected


@given(st.integers(-(2**63), 2**63 - 1), st.lists(st.integers(0, 3), min_size=1, max_size=64))
def test_the_compiled_walk_chains_from_any_seed(seed: int, token_ids: list[int]) -> None:
    """The table walk names blocks from the int hash of each name, computed in C: the same
    chain as ``hash((name, block))`` from any 64-bit seed (negative, -1, the extremes)."""
    names = python_chain_names(token_ids, 1, 0, len(token_ids), seed)
    table = new_holders()
    for name in names:
        table[name] = 1
    expected = python_walk_chain(token_ids, 1, len(token_ids), seed, table, 1)
    assert walk_chain(token_ids, 1, len(token_ids), seed, table, 1) == expected
    assert expected == [(len(token_ids), 1)]


_holder_ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "get", "in"]),
        st.one_of(st.integers(-40, 40), st.integers(-(2**63), 2**63 - 1)),
        st.integers(1, 2**70),
    ),
    max_size=400,
)


@given(_holder_ops)
def test_the_compiled_holders_read_as_a_dict(ops: list[tuple[str, int, int]]) -> None:
    """Sets, deletes (which move later slots of a probe run back) and reads, with keys
    that collide in the table and masks wider than 64 bits."""
    table, reference = new_holders(), dict[int, int]()
    for op, name, mask in ops:
        if op == "set":
            table[name] = reference[name] = mask
        elif op == "del" and name in reference:
            del table[name]
            del reference[name]
        assert table.get(name, 0) == reference.get(name, 0)
        assert (name in table) == (name in reference)
        assert len(table) == len(reference)
    assert all(table.get(name, 0) == mask for name, mask in reference.items())


def test_the_compiled_holders_refuse_what_no_index_stores() -> None:
    table = new_holders()
    if isinstance(table, dict):
        pytest.skip("the extension is not built (test_names_are_computed... fails then)")
    with pytest.raises(ValueError, match="positive"):
        table[1] = 0
    with pytest.raises(OverflowError):
        table[2**64] = 1
    with pytest.raises(KeyError):
        del table[3]
    assert table.get(2**70, 0) == 0 and 2**70 not in table


def test_the_index_keeps_its_blocks_in_the_compiled_table() -> None:
    assert not isinstance(PrefixIndex()._holders, dict)


@pytest.mark.parametrize("chain", [chain_names, python_chain_names])
def test_asking_for_more_blocks_than_the_tokens_hold_is_an_error(
    chain: Callable[[list[int], int, int, int, int], list[int]],
) -> None:
    with pytest.raises(ValueError, match="fewer full blocks"):
        chain(tokens(7), 4, 1, 1, 0)
    with pytest.raises(ValueError, match="fewer full blocks"):
        chain(tokens(7), 4, 2**62, 2**62, 0)


def test_lora_and_model_separate_names() -> None:
    base = block_names(tokens(8), SIZE, chain_seed(MODEL, None))
    assert base != block_names(tokens(8), SIZE, chain_seed(MODEL, "sql"))
    assert base != block_names(tokens(8), SIZE, chain_seed("other", None))


def test_engine_map_names_as_the_prompt_does() -> None:
    blocks = EngineBlockMap(MODEL, SIZE)
    first = blocks.store(stored(tokens(8)))
    second = blocks.store(stored(tokens(8, 1008), first=2, parent=1))
    assert first + second == block_names(tokens(16), SIZE, chain_seed(MODEL, None))
    assert blocks.store(stored(tokens(4, 5000), first=9, parent=77)) == []  # unknown parent
    assert blocks.unnamed == 1


# ---------------------------------------------------------------------- index


def test_stored_removed_cleared() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    prompt = tokens(17)  # 4 full blocks count (the last token never does)
    feed.send("w1", stored(prompt[:16]))
    assert index.match(MODEL, None, prompt, ["w1"]) == {"w1": 4}
    feed.send("w1", RemovedBlocks([2, 3]))
    assert index.match(MODEL, None, prompt, ["w1"]) == {"w1": 2}
    feed.send("w1", ClearedBlocks())
    assert index.match(MODEL, None, prompt, ["w1"]) == {}
    assert index.blocks() == 0


def test_removed_head_block_is_never_matched() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("w1", stored(tokens(16)))
    feed.send("w1", RemovedBlocks([0]))
    assert index.match(MODEL, None, tokens(17), ["w1"]) == {}


def test_match_per_worker_and_lora() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("w1", stored(tokens(16)))
    feed.send("w2", stored(tokens(8)))
    feed.send("w3", stored(tokens(16), lora="sql"))
    prompt = tokens(17)
    assert index.match(MODEL, None, prompt, ["w1", "w2", "w3"]) == {"w1": 4, "w2": 2}
    assert index.match(MODEL, "sql", prompt, ["w1", "w2", "w3"]) == {"w3": 4}
    assert index.match(MODEL, None, prompt, ["w2"]) == {"w2": 2}
    assert index.match("other", None, prompt, ["w1"]) == {}


def test_dead_worker_dropped_and_bit_reused() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("w1", stored(tokens(16)))
    index.drop("w1")
    assert index.match(MODEL, None, tokens(17), ["w1"]) == {}
    assert index.blocks() == 0
    feed.send("w2", stored(tokens(8, 7000)))
    assert index.match(MODEL, None, tokens(17), ["w2"]) == {}
    assert index.blocks_by_worker() == {"w2": 2}


def test_worker_serving_another_model_matches_only_its_new_model() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("w1", stored(tokens(16)))
    feed.send("w2", stored(tokens(16)))
    index.drop("w1")
    assert index.match(MODEL, None, tokens(17), ["w1", "w2"]) == {"w2": 4}
    feed.seq["w1"] = -1  # back (batch 0), serving "other"
    feed.send("w1", stored(tokens(16)), model="other")
    assert index.match(MODEL, None, tokens(17), ["w1", "w2"]) == {"w2": 4}
    assert index.match("other", None, tokens(17), ["w1", "w2"]) == {"w1": 4}


def test_workers_of_another_block_size_are_matched_once_the_old_ones_are_gone() -> None:
    """A model's fake-engine workers (4-token blocks here) replaced by workers of another
    engine (8-token blocks): once the old ones are dropped, the new ones' blocks match."""
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("old", stored(tokens(16)))
    new_blocks = StoredBlocks([50, 51], None, tokens(16), None)
    index.apply(KvBatch("new", MODEL, 2 * SIZE, 0, [new_blocks]))
    assert index.match(MODEL, None, tokens(17), ["new"]) == {}  # the model's size is 4
    index.drop("old")
    assert index.block_size(MODEL) == 2 * SIZE
    assert index.match(MODEL, None, tokens(17), ["new"]) == {"new": 2}
    index.drop("new")
    assert index.block_size(MODEL) is None


def test_gap_drops_blocks_until_the_snapshot() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    mirror = EngineBlockMap(MODEL, SIZE)  # the worker's own copy, for its snapshot
    first = stored(tokens(8))
    mirror.store(first)
    feed.send("w1", first)
    lost = stored(tokens(8, 1008), first=2, parent=1)
    mirror.store(lost)
    feed.seq["w1"] += 1  # batch 1 never arrives
    later = RemovedBlocks([0])
    mirror.remove([0])
    assert not feed.send("w1", later)
    assert index.lost("w1") and index.gaps == 1
    assert index.match(MODEL, None, tokens(17), ["w1"]) == {}
    assert index.load(KvSnapshot("w1", MODEL, SIZE, 2, mirror.pairs()))
    assert not index.lost("w1")
    assert index.blocks_by_worker() == {"w1": 3}
    # block 0 was removed: nothing of the prompt matches from its start
    assert index.match(MODEL, None, tokens(17), ["w1"]) == {}
    assert feed.send("w1", stored(tokens(4), first=10))
    assert index.match(MODEL, None, tokens(17), ["w1"]) == {"w1": 4}


def test_batches_read_again_after_a_snapshot_change_nothing() -> None:
    index = PrefixIndex()
    first = KvBatch("w1", MODEL, SIZE, 0, [stored(tokens(8))])
    second = KvBatch("w1", MODEL, SIZE, 1, [RemovedBlocks([1])])
    mirror = EngineBlockMap(MODEL, SIZE)
    mirror.store(stored(tokens(8)))
    mirror.remove([1])
    index.load(KvSnapshot("w1", MODEL, SIZE, 1, mirror.pairs()))  # a gateway starting
    assert index.apply(first) and index.apply(second)  # the stream from its start
    assert index.blocks_by_worker() == {"w1": 1}


def test_old_snapshot_does_not_replace_newer_state() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("w1", stored(tokens(8)))
    assert not index.load(KvSnapshot("w1", MODEL, SIZE, -1, []))
    assert index.blocks_by_worker() == {"w1": 2}


def test_unknown_worker_mid_stream_waits_for_snapshot() -> None:
    index = PrefixIndex()
    assert not index.apply(KvBatch("w9", MODEL, SIZE, 5, [stored(tokens(8))]))
    assert index.lost("w9")
    assert index.blocks_by_worker() == {"w9": -1}


def test_index_bound() -> None:
    index = PrefixIndex(max_blocks=3)
    Feed(index).send("w1", stored(tokens(16)))
    assert index.blocks() == 3 and index.not_indexed == 1


# ---------------------------------------------------------------------- properties

_worker_ids = st.sampled_from(["a", "b", "c"])
_events = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 5), st.integers(1, 3)),
        st.tuples(st.just("remove"), st.integers(0, 8), st.just(1)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    ),
    max_size=12,
)


def _batches(worker_id: str, script: list[tuple[str, int, int]]) -> list[KvBatch]:
    """A worker's batches from a script: stores chain from block ``at`` for ``count``."""
    batches = []
    for seq, (kind, at, count) in enumerate(script):
        event: KvEvent
        if kind == "store":
            parent = None if at == 0 else at - 1
            event = StoredBlocks(
                list(range(at, at + count)), parent, tokens(count * SIZE, at * SIZE)
            )
        elif kind == "remove":
            event = RemovedBlocks([at])
        else:
            event = ClearedBlocks()
        batches.append(KvBatch(worker_id, MODEL, SIZE, seq, [event]))
    return batches


def _state(index: PrefixIndex) -> dict[str, int]:
    prompt = tokens(40, 0)
    return index.match(MODEL, None, prompt, ["a", "b", "c"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_worker_ids, _events, min_size=1), st.randoms(use_true_random=False))
def test_any_interleaving_of_workers_gives_the_same_index(
    scripts: dict[str, list[tuple[str, int, int]]], rnd: random.Random
) -> None:
    in_order = PrefixIndex()
    for worker_id in sorted(scripts):
        for batch in _batches(worker_id, scripts[worker_id]):
            in_order.apply(batch)
    queues = {w: _batches(w, s) for w, s in scripts.items()}
    mixed = PrefixIndex()
    while any(queues.values()):
        worker_id = rnd.choice([w for w, q in queues.items() if q])
        mixed.apply(queues[worker_id].pop(0))
    assert _state(mixed) == _state(in_order)
    assert mixed.blocks_by_worker() == in_order.blocks_by_worker()
    assert mixed.blocks() == in_order.blocks()


@settings(max_examples=200, deadline=None)
@given(_events, st.integers(0, 8))
def test_a_removed_block_is_never_matched(script: list[tuple[str, int, int]], removed: int) -> None:
    index = PrefixIndex()
    batches = _batches("a", script)
    for batch in batches:
        index.apply(batch)
    index.apply(KvBatch("a", MODEL, SIZE, len(batches), [RemovedBlocks([removed])]))
    matched = index.match(MODEL, None, tokens(40, 0), ["a"]).get("a", 0)
    assert matched <= removed  # blocks from ``removed`` on never match


# ---------------------------------------------------------------------- pending


def coming(worker_id: str, token_ids: list[int], lora: str | None = None) -> PendingBlocks:
    return PendingBlocks(worker_id, block_names(token_ids, SIZE, chain_seed(MODEL, lora)))


def test_announced_blocks_match_until_they_expire() -> None:
    index = PrefixIndex(pending_s=5)
    feed = Feed(index)
    feed.send("a", stored(tokens(4)))
    index.pending(coming("a", tokens(16)), now=100)
    assert index.match(MODEL, None, tokens(17), ["a"]) == {"a": 4}
    assert index.pending_blocks() == 3  # the stored first block is not claimed again
    index.expire(104.9)
    assert index.match(MODEL, None, tokens(17), ["a"]) == {"a": 4}
    index.expire(105)
    assert index.match(MODEL, None, tokens(17), ["a"]) == {"a": 1}
    assert index.pending_blocks() == 0


def test_stored_blocks_end_their_claim_and_do_not_expire() -> None:
    index = PrefixIndex(pending_s=5)
    feed = Feed(index)
    feed.send("a", stored(tokens(4)))
    index.pending(coming("a", tokens(16)), now=100)
    feed.send("a", stored(tokens(12, 1004), first=1, parent=0))
    assert index.pending_blocks() == 0
    index.expire(200)
    assert index.match(MODEL, None, tokens(17), ["a"]) == {"a": 4}


def test_an_announcement_again_renews_the_claim() -> None:
    index = PrefixIndex(pending_s=5)
    Feed(index).send("a", ClearedBlocks())
    index.pending(coming("a", tokens(8)), now=100)
    index.pending(coming("a", tokens(8)), now=103)
    index.expire(106)
    assert index.match(MODEL, None, tokens(9), ["a"]) == {"a": 2}
    index.expire(108)
    assert index.match(MODEL, None, tokens(9), ["a"]) == {}


def test_announcements_count_for_nothing_with_no_time_to_count() -> None:
    index = PrefixIndex(pending_s=0)
    Feed(index).send("a", ClearedBlocks())
    index.pending(coming("a", tokens(8)), now=0)
    assert index.match(MODEL, None, tokens(9), ["a"]) == {}


def test_announcements_of_unknown_or_lost_workers_are_ignored() -> None:
    index = PrefixIndex()
    index.pending(coming("a", tokens(8)), now=0)
    assert index.pending_blocks() == 0
    Feed(index).send("b", ClearedBlocks())
    index.apply(KvBatch("b", MODEL, SIZE, 5, []))  # a gap: b waits for its snapshot
    index.pending(coming("b", tokens(8)), now=0)
    assert index.pending_blocks() == 0


def test_a_dropped_or_restarted_worker_loses_its_claims() -> None:
    index = PrefixIndex()
    feed = Feed(index)
    feed.send("a", ClearedBlocks())
    feed.send("b", ClearedBlocks())
    index.pending(coming("a", tokens(8)), now=0)
    index.pending(coming("b", tokens(8)), now=0)
    index.drop("a")
    index.load(KvSnapshot("b", MODEL, SIZE, 3, []))  # b rebuilt from its snapshot
    assert index.match(MODEL, None, tokens(9), ["a", "b"]) == {}
    assert index.blocks() == 0
    index.expire(float("inf"))  # the old claims' expiry finds nothing to remove


# ---------------------------------------------------------------------- placer


def placer(index: PrefixIndex, **policy: float) -> CachePlacer:
    return CachePlacer(index, CostPolicy(**policy), rng=random.Random(7))  # type: ignore[arg-type]


def test_cache_wins_at_equal_load() -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    placement = placer(index).place(request(tokens(17)), [candidate("w1"), candidate("w2")])
    assert (placement.worker_id, placement.reason, placement.matched_blocks) == (
        "w2",
        PlacementReason.CACHE,
        4,
    )


def test_load_outweighs_a_small_hit() -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(4)))
    placement = placer(index).place(
        request(tokens(17)), [candidate("w1"), candidate("w2", running=3)]
    )
    assert (placement.worker_id, placement.reason) == ("w1", PlacementReason.LOAD)


def test_queue_weight_lets_a_hit_outweigh_a_longer_queue() -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    workers = [candidate("w1"), candidate("w2", queued=6 * SIZE)]  # 6 blocks queued vs 4 held
    assert placer(index, queue_weight=1).place(request(tokens(17)), workers).worker_id == "w1"
    placement = placer(index).place(request(tokens(17)), workers)  # the default, 0.5
    assert (placement.worker_id, placement.reason) == ("w2", PlacementReason.CACHE)


def test_equal_cost_goes_to_the_least_loaded_then_at_random() -> None:
    index = PrefixIndex()
    Feed(index).send("w1", stored(tokens(16)))
    # each costs 4 blocks: w1 holds the prompt's 4 but has 8 blocks of prefill queued (at
    # the default queue weight, 0.5)
    cands = [candidate("w1", queued=32), candidate("w2", waiting=1), candidate("w3")]
    chosen = {
        CachePlacer(index, rng=random.Random(seed)).place(request(tokens(17)), cands).worker_id
        for seed in range(40)
    }
    assert chosen == {"w1", "w3"}


def test_busy_worker_skipped() -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    chosen = placer(index).place(
        request(tokens(17)), [candidate("w1"), candidate("w2", waiting=32)]
    )
    assert (chosen.worker_id, chosen.reason) == ("w1", PlacementReason.LOAD)
    full = placer(index).place(request(tokens(17)), [candidate("w1"), candidate("w2", kv=0.99)])
    assert full.worker_id == "w1"
    alone = placer(index).place(request(tokens(17)), [candidate("w2", kv=0.99)])
    assert (alone.worker_id, alone.reason) == (None, PlacementReason.FULL)


def test_when_every_open_worker_has_jobs_waiting_the_cost_chooses_among_them() -> None:
    """On the shared stream any of them would take the job at once, whatever it holds."""
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    cands = [candidate("w1", waiting=3), candidate("w2", waiting=2)]
    chosen = placer(index, busy_waiting=2).place(request(tokens(17)), cands)
    assert (chosen.worker_id, chosen.reason) == ("w2", PlacementReason.CACHE)
    busier = [candidate("w1", waiting=2), candidate("w2", waiting=2, queued=20 * SIZE)]
    assert placer(index, busy_waiting=2).place(request(tokens(17)), busier).worker_id == "w1"


def test_worker_without_a_free_slot_skipped() -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    cands = [candidate("w1", running=8), candidate("w2", running=8, free_slots=0)]
    chosen = placer(index).place(request(tokens(17)), cands)
    assert (chosen.worker_id, chosen.reason) == ("w1", PlacementReason.LOAD)
    alone = placer(index).place(request(tokens(17)), cands[1:])
    assert (alone.worker_id, alone.reason) == (None, PlacementReason.FULL)


def test_cache_key_affinity() -> None:
    index = PrefixIndex()
    place = placer(index)
    first = place.place(request(tokens(9), cache_key="k"), [candidate("w1"), candidate("w2")])
    assert first.reason is PlacementReason.LOAD
    other = "w2" if first.worker_id == "w1" else "w1"
    loaded = [candidate(first.worker_id or "", running=1), candidate(other)]
    again = place.place(request(tokens(9, 5000), cache_key="k"), loaded)
    assert (again.worker_id, again.reason) == (first.worker_id, PlacementReason.CACHE_KEY)
    no_key = place.place(request(tokens(9, 5000)), loaded)
    assert (no_key.worker_id, no_key.reason) == (None, PlacementReason.SHARED)


def test_lora_only_on_workers_with_the_adapter() -> None:
    index = PrefixIndex()
    Feed(index).send("w1", stored(tokens(16), lora="sql"))
    cands = [candidate("w1"), candidate("w2", adapters=frozenset({"sql"}))]
    placement = placer(index).place(request(tokens(17), lora="sql"), cands)
    assert (placement.worker_id, placement.reason) == ("w2", PlacementReason.LOAD)
    assert (
        placer(index).place(request(tokens(17), lora="x"), cands).reason is PlacementReason.SHARED
    )


@pytest.mark.parametrize("token_ids", [None, tokens(17)])
def test_empty_index_leaves_the_job_to_the_pull_queue(token_ids: list[int] | None) -> None:
    placement = placer(PrefixIndex()).place(
        request(token_ids),
        [candidate("w1", running=2), candidate("w2", queued=64), candidate("w3")],
    )
    assert (placement.worker_id, placement.reason) == (None, PlacementReason.SHARED)


def test_a_prefix_every_worker_holds_wins_nothing() -> None:
    index = PrefixIndex()
    for worker in ("w1", "w2"):
        Feed(index).send(worker, stored(tokens(16)))
    placement = placer(index).place(request(tokens(40)), [candidate("w1"), candidate("w2")])
    assert (placement.worker_id, placement.reason) == (None, PlacementReason.SHARED)


def test_a_lone_free_worker_is_placed_by_load() -> None:
    placement = placer(PrefixIndex()).place(request(tokens(17)), [candidate("w3")])
    assert (placement.worker_id, placement.reason) == ("w3", PlacementReason.LOAD)


def test_no_candidates_is_shared() -> None:
    assert placer(PrefixIndex()).place(request(tokens(9)), []).reason is PlacementReason.SHARED


def test_on_placed_sees_every_decision() -> None:
    seen = []
    place = CachePlacer(PrefixIndex(), on_placed=lambda r, p: seen.append(p.reason))
    place.place(request(tokens(9)), [candidate("w1")])
    place.place(request(tokens(9)), [])
    assert seen == [PlacementReason.LOAD, PlacementReason.SHARED]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 200_000), min_size=SIZE, max_size=12 * SIZE),
    st.lists(st.integers(1, 4), min_size=1, max_size=12),
)
def test_names_do_not_depend_on_how_blocks_are_batched(
    token_ids: list[int], runs: list[int]
) -> None:
    """Stored in runs of any length, the blocks get the prompt's names, and a prompt that
    is exactly the stored blocks plus one token matches all of them."""
    full = len(token_ids) // SIZE
    blocks = EngineBlockMap(MODEL, SIZE)
    index = PrefixIndex()
    feed = Feed(index)
    first = 0
    names: list[int] = []
    for run in runs:
        count = min(run, full - first)
        if count <= 0:
            break
        parent = None if first == 0 else first - 1
        event = StoredBlocks(
            list(range(first, first + count)),
            parent,
            token_ids[first * SIZE : (first + count) * SIZE],
        )
        names += blocks.store(event)
        feed.send("w1", event)
        first += count
    assert names == block_names(token_ids, SIZE, chain_seed(MODEL, None))[:first]
    assert index.match(MODEL, None, [*token_ids[: first * SIZE], 7], ["w1"]).get("w1", 0) == first


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=14 * SIZE),
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.tuples(st.integers(0, 14), st.lists(st.integers(0, 13), max_size=4), st.booleans()),
        max_size=4,
    ),
)
def test_walk_stops_where_the_full_naming_says(
    token_ids: list[int], held: dict[str, tuple[int, list[int], bool]]
) -> None:
    """The walk names a block only while some worker holds every block before it; each
    worker's match is still the run of leading blocks it holds, as naming the whole
    prompt and checking every block says. Workers hold a prefix of the prompt's chain
    (or of a chain that differs from the second token on) with holes removed."""
    names = block_names(token_ids, SIZE, chain_seed(MODEL, None))
    index = PrefixIndex()
    feed = Feed(index)
    holds: dict[str, set[int]] = {}
    for worker_id, (count, holes, other) in held.items():
        chain = [*token_ids[:1], *(t + 1 for t in token_ids[1:])] if other else token_ids
        count = min(count, len(chain) // SIZE)
        feed.send(worker_id, stored(chain[: count * SIZE]), RemovedBlocks(holes))
        kept = set(block_names(chain[: count * SIZE], SIZE, chain_seed(MODEL, None)))
        holds[worker_id] = kept - {names[h] for h in holes if h < len(names)}
    usable = max(0, (len(token_ids) - 1) // SIZE)
    expected = {}
    for worker_id, own in holds.items():
        run = 0
        while run < usable and names[run] in own:
            run += 1
        if run:
            expected[worker_id] = run
    assert index.match(MODEL, None, token_ids, sorted(held)) == expected


def test_the_debug_line_shows_what_each_candidate_held_and_carried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = PrefixIndex()
    Feed(index).send("w2", stored(tokens(16)))
    with caplog.at_level(logging.DEBUG, logger="gateway.placement.cache_placer"):
        placer(index).place(request(tokens(17)), [candidate("w1"), candidate("w2", running=2)])
    line = caplog.records[-1].getMessage()
    assert "on w2: cache, 4 blocks cached there" in line
    assert "w1 (blocks 0, running 0" in line
    assert "w2 (blocks 4, running 2" in line
