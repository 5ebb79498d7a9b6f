"""Conveyor's own names for KV cache blocks, independent of any engine's hash.

A block's name chains over the token ids, one full block at a time:
``name(i) = hash((name(i - 1), tokens of block i))``, starting from a seed made of the
model and the LoRA adapter, so an adapter's blocks never match its base model's (llm-d's
approach: the engine's own block hashes depend on its hash function and seed; ours only
on the tokens). ``hash`` is CPython's hash of a tuple of ints: the same in every process
(``PYTHONHASHSEED`` changes only the hashes of str and bytes) and fast: compiled, about
3 ns per token, several times faster than a cryptographic hash. It is not keyed, so a client could
craft a prompt whose block names collide with another tenant's: that only misroutes its
own request (a worse placement, never a wrong answer: the engine matches its cache with
its own hashes).

The gateway names a prompt's blocks and matches them against its index on the request
path, so :func:`chain_names` and :func:`walk_chain` run in C (``shared/_chain.c``, built
at install: the same hash, with no tuple built). :func:`python_chain_names` and
:func:`python_walk_chain` define them, and a property test holds the compiled ones to
them; they serve only where the extension could not be built (no C compiler), and the
gateway then logs a warning at start-up (:data:`COMPILED`).

:class:`EngineBlockMap` keeps one engine's cached blocks under these names (engine hash ->
name): the gateway's index holds one per worker, built from the worker's KV events, and
the worker holds one to write its snapshots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import islice
from typing import Any, Protocol

from shared.queue.kv_events import KvEvent, RemovedBlocks, StoredBlocks


class HolderMap(Protocol):
    """Block name -> bit mask of the workers holding the block (masks positive): a dict,
    or the compiled table :func:`new_holders` makes."""

    def __len__(self) -> int: ...
    def __setitem__(self, name: int, mask: int, /) -> None: ...
    def __delitem__(self, name: int, /) -> None: ...
    def __contains__(self, name: object, /) -> bool: ...
    def get(self, name: int, default: int, /) -> int: ...


Tokens = list[int] | tuple[int, ...]
_compiled_chain_names: Callable[[Tokens, int, int, int, int], list[int]] | None
_compiled_walk_chain: Callable[[Tokens, int, int, int, Any, int], list[tuple[int, int]]] | None
_compiled_holders: Callable[[], HolderMap] | None
try:
    from shared import _chain

    _compiled_chain_names, _compiled_walk_chain = _chain.chain_names, _chain.walk_chain
    _compiled_holders = getattr(_chain, "Holders", None)  # 64-bit builds only
except ImportError:  # built without a C compiler: see COMPILED
    _compiled_chain_names = _compiled_walk_chain = _compiled_holders = None

COMPILED = _compiled_chain_names is not None
"""Whether block names are computed by the C extension (else by the Python reference)."""


def new_holders() -> HolderMap:
    """An empty :class:`HolderMap`: the compiled table where the extension has it (a walk
    reads one slot per block there, against four cache lines of a dict), else a dict."""
    return _compiled_holders() if _compiled_holders is not None else {}


@lru_cache(maxsize=4096)
def chain_seed(model: str, lora: str | None) -> int:
    """The name a chain of ``model``'s blocks starts from (``lora``: an adapter's chain)."""
    digest = hashlib.blake2b(f"{model}\0{lora or ''}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt an engine can reuse: never the last token's (vLLM computes it)."""
    return max(0, (num_tokens - 1) // block_size)


def blocks_of(token_ids: Sequence[int], block_size: int, count: int) -> Iterator[tuple[int, ...]]:
    """The first ``count`` blocks of ``token_ids``, each a tuple, cut lazily (callers check
    that ``count`` blocks are full)."""
    # zip over one iterator repeated block_size times: each block is filled in C straight
    # from the list, with no copy of the whole prompt and no slice object per block (a last,
    # partial block is left out)
    return islice(zip(*[iter(token_ids)] * block_size, strict=False), count)


def block_names(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The names of every full block of ``token_ids``, in order."""
    return chain_names(token_ids, block_size, 0, len(token_ids) // block_size, seed)


def chain_names(
    token_ids: Sequence[int], block_size: int, start: int, count: int, name: int
) -> list[int]:
    """The names of blocks ``start`` to ``start + count - 1`` of ``token_ids`` (all full),
    chained from ``name``: the name of block ``start - 1``, or the chain's seed."""
    if _compiled_chain_names is not None and isinstance(token_ids, list | tuple):
        return _compiled_chain_names(token_ids, block_size, start, count, name)
    return python_chain_names(token_ids, block_size, start, count, name)


def python_chain_names(
    token_ids: Sequence[int], block_size: int, start: int, count: int, name: int
) -> list[int]:
    """:func:`chain_names` in Python: the definition, ``name = hash((name, block))``."""
    if count < 0 or (start + count) * block_size > len(token_ids):
        raise ValueError("token_ids hold fewer full blocks than asked for")
    names = []
    tail = token_ids[start * block_size :] if start else token_ids
    for block in blocks_of(tail, block_size, count):
        name = hash((name, block))
        names.append(name)
    return names


WIDE_MASK = 1 << 64
"""Worker masks from here on (more than 64 workers' bits) are walked in Python."""


def walk_chain(
    token_ids: Sequence[int],
    block_size: int,
    count: int,
    seed: int,
    holders: HolderMap,
    held: int,
) -> list[tuple[int, int]]:
    """Walk the chain of the first ``count`` blocks' names from ``seed`` while some bits of
    ``held`` hold them (``holders``: name -> bit mask). Returns, in order, ``(depth,
    dropped)``: the bits of ``held`` that stopped holding at that depth (the number of
    blocks they held), and last the bits that held every block (depth ``count``)."""
    if (
        _compiled_walk_chain is not None
        and held < WIDE_MASK
        and isinstance(token_ids, list | tuple)
    ):
        return _compiled_walk_chain(token_ids, block_size, count, seed, holders, held)
    return python_walk_chain(token_ids, block_size, count, seed, holders, held)


def python_walk_chain(
    token_ids: Sequence[int],
    block_size: int,
    count: int,
    seed: int,
    holders: HolderMap,
    held: int,
) -> list[tuple[int, int]]:
    """:func:`walk_chain` in Python (its definition); names a block only when every block
    before it was held."""
    if count < 0 or count * block_size > len(token_ids):
        raise ValueError("token_ids hold fewer full blocks than asked for")
    steps: list[tuple[int, int]] = []
    name, depth = seed, 0
    for block in blocks_of(token_ids, block_size, count):
        if not held:
            return steps
        name = hash((name, block))
        now = holders.get(name, 0) & held
        if now != held:
            steps.append((depth, held & ~now))
            held = now
        depth += 1
    if held:
        steps.append((depth, held))
    return steps


class EngineBlockMap:
    """One engine's cached blocks: its block hash -> Conveyor's name for the block.

    A stored block whose parent is unknown here (stored before this map started, or
    itself not named) cannot be named and is left out: its chain cannot be matched from
    a prompt's start anyway.
    """

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self._names: dict[int, int] = {}
        self.unnamed = 0
        """Stored blocks left out since the start (their parent was unknown)."""

    def __len__(self) -> int:
        return len(self._names)

    def apply(self, event: KvEvent) -> tuple[list[int], list[int]]:
        """Apply one event; returns the names it added and those it removed."""
        if isinstance(event, StoredBlocks):
            return self.store(event), []
        if isinstance(event, RemovedBlocks):
            return [], self.remove(event.engine_hashes)
        return [], self.clear()

    def store(self, event: StoredBlocks) -> list[int]:
        """Name the event's blocks; returns the names this engine did not hold before."""
        if event.parent is None:
            name: int | None = chain_seed(self.model, event.lora)
        else:
            name = self._names.get(event.parent)
        if name is None:
            self.unnamed += len(event.engine_hashes)
            return []
        hashes = event.engine_hashes
        full = min(len(hashes), len(event.token_ids) // self.block_size)
        self.unnamed += len(hashes) - full
        added = []
        names = chain_names(event.token_ids, self.block_size, 0, full, name)
        for engine_hash, block_name in zip(hashes[:full], names, strict=True):
            if engine_hash not in self._names:
                self._names[engine_hash] = block_name
                added.append(block_name)
        return added

    def remove(self, engine_hashes: Iterable[int]) -> list[int]:
        """Forget blocks; returns the names of those that were held."""
        removed = []
        for engine_hash in engine_hashes:
            name = self._names.pop(engine_hash, None)
            if name is not None:
                removed.append(name)
        return removed

    def clear(self) -> list[int]:
        """Forget every block; returns their names."""
        names = list(self._names.values())
        self._names.clear()
        return names

    def load(self, pairs: Iterable[tuple[int, int]]) -> list[int]:
        """Replace the contents with ``(engine hash, name)`` pairs (a snapshot); returns
        the names now held."""
        self._names = dict(pairs)
        return list(self._names.values())

    def pairs(self, limit: int | None = None) -> list[tuple[int, int]]:
        """``(engine hash, name)`` of the blocks held, oldest first (at most ``limit``)."""
        items = self._names.items()
        if limit is not None and len(items) > limit:
            return list(items)[-limit:]
        return list(items)
