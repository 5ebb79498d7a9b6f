"""The gateway's prefix index: which workers hold which KV blocks, per model and adapter.

Fed with every worker's KV events (:mod:`gateway.placement.index_feeder`), it names each
stored block itself from the block's token ids (:mod:`shared.block_hashes`: chained over
the tokens, seeded with the model and LoRA adapter), so the index never depends on an
engine's hash function and an adapter's blocks never match its base model's. Each
worker keeps its engine hash -> name map for removals.

Memory: one dict entry per distinct block name (name -> a bit mask of the workers holding
it, ~100 bytes) plus one per (worker, block) in the workers' maps (~100 bytes); at 100k
indexed blocks about 20 MB (``python -m bench.placement_cost`` measures it).
``max_blocks`` bounds the names: past it new blocks are not indexed (fewer matches,
never a wrong one).

Blocks a worker announced as coming (a job that will prefill them started there) count
as held by it (:meth:`PrefixIndex.pending`) until its engine's events store them or
``pending_s`` passes, whichever is first: a request sent while its prefix is still being
prefilled can follow it instead of prefilling it again elsewhere.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from operator import or_

from shared.block_hashes import (
    EngineBlockMap,
    chain_seed,
    new_holders,
    prompt_blocks,
    walk_chain,
)
from shared.queue.kv_events import KvBatch, KvEvent, KvSnapshot, PendingBlocks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Worker:
    bit: int
    blocks: EngineBlockMap
    seq: int | None
    """The last batch applied; None: a batch was lost, the blocks wait for a snapshot."""
    pending: dict[int, float] = field(default_factory=dict)
    """Names of blocks announced as coming, not stored yet -> when the claim expires."""


PENDING_S = 10.0
"""How long an announced block counts as held before its engine reports it."""


class PrefixIndex:
    def __init__(self, *, max_blocks: int = 1_000_000, pending_s: float = PENDING_S) -> None:
        self.max_blocks = max_blocks
        self.pending_s = pending_s
        self._expiries: deque[tuple[float, str, list[int]]] = deque()
        """Announcements in the order they expire: (when, worker, names)."""
        self._holders = new_holders()
        """Block name -> bit mask of the workers holding it."""
        self._workers: dict[str, _Worker] = {}
        self._masks: dict[str, dict[str, int]] = {}
        """Model -> its workers' bit masks (kept beside ``_workers``: a placement reads them)."""
        self._free_bits: list[int] = []
        self._block_size: dict[str, int] = {}
        self.gaps = 0
        """Batches found missing (each dropped a worker's blocks until its snapshot)."""
        self.not_indexed = 0
        """Stored blocks left out because the index was full."""
        self._full_logged = False

    # ------------------------------------------------------------------ queries

    def block_size(self, model: str) -> int | None:
        """The KV block size of ``model``'s engines (None: no worker of it indexed yet)."""
        return self._block_size.get(model)

    def blocks(self) -> int:
        """Distinct block names indexed."""
        return len(self._holders)

    def blocks_by_worker(self) -> dict[str, int]:
        """Blocks each indexed worker holds (-1: lost track, waiting for its snapshot)."""
        return {
            worker_id: -1 if worker.seq is None else len(worker.blocks)
            for worker_id, worker in self._workers.items()
        }

    def pending_blocks(self) -> int:
        """Announced blocks counted as held, not stored yet (summed over workers)."""
        return sum(len(worker.pending) for worker in self._workers.values())

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def lost(self, worker_id: str) -> bool:
        """Whether the worker's batches cannot be applied until a snapshot (or unknown)."""
        worker = self._workers.get(worker_id)
        return worker is None or worker.seq is None

    def match(
        self, model: str, lora: str | None, token_ids: Sequence[int], worker_ids: Sequence[str]
    ) -> dict[str, int]:
        """How many of the prompt's first blocks each of ``worker_ids`` holds (workers with
        none are left out). Walks the prompt's chain of block names until no worker
        holds the next one."""
        size = self._block_size.get(model)
        if size is None:
            return {}
        of_model = self._masks.get(model, {})
        masks = {
            worker_id: of_model[worker_id] for worker_id in worker_ids if worker_id in of_model
        }
        held = reduce(or_, masks.values(), 0)
        if not held:
            return {}
        matched: dict[str, int] = {}
        # the walk names a block only while some worker holds every block before it, and
        # runs in C (shared.block_hashes.walk_chain): it is the cost of a placement
        for depth, dropped in walk_chain(
            token_ids,
            size,
            prompt_blocks(len(token_ids), size),
            chain_seed(model, lora),
            self._holders,
            held,
        ):
            _record(matched, masks, dropped, depth)
        return matched

    # ------------------------------------------------------------------ changes

    def apply(self, batch: KvBatch) -> bool:
        """Apply one batch; False when it cannot be (a batch before it is missing, or the
        worker is unknown here): the worker's blocks wait for its snapshot."""
        worker = self._workers.get(batch.worker_id)
        if worker is not None and worker.seq is not None and batch.seq <= worker.seq:
            return True  # already applied (read again, or included in the snapshot)
        if batch.seq == 0:
            worker = self._fresh(batch.worker_id, batch.model, batch.block_size)
        elif worker is None:
            self._fresh(batch.worker_id, batch.model, batch.block_size).seq = None
            return False
        elif worker.seq is None:
            return False
        elif batch.seq != worker.seq + 1:
            self.gaps += 1
            log.info(
                "KV events of worker %s: batch %d after %d, a gap; its blocks wait for its "
                "snapshot",
                batch.worker_id,
                batch.seq,
                worker.seq,
            )
            self._unset(worker, worker.blocks.clear())
            worker.seq = None
            return False
        for event in batch.events:
            self._apply_event(worker, event)
        worker.seq = batch.seq
        return True

    def pending(self, announced: PendingBlocks, now: float) -> None:
        """Count the announced blocks as held by their worker until ``now + pending_s``
        (a worker not indexed, or waiting for its snapshot, is left as it is; with
        ``pending_s`` 0 announcements are not counted at all)."""
        worker = self._workers.get(announced.worker_id)
        if worker is None or worker.seq is None or self.pending_s <= 0:
            return
        until = now + self.pending_s
        mask = 1 << worker.bit
        holders = self._holders
        claimed = []
        for name in announced.names:
            if name in worker.pending:
                worker.pending[name] = until
            elif holders.get(name, 0) & mask:
                continue  # stored already
            elif len(holders) >= self.max_blocks and name not in holders:
                self._full()
                continue
            else:
                holders[name] = holders.get(name, 0) | mask
                worker.pending[name] = until
            claimed.append(name)
        if claimed:
            self._expiries.append((until, announced.worker_id, claimed))

    def expire(self, now: float) -> None:
        """Drop the announced blocks whose engine has not stored them in time."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, worker_id, names = expiries.popleft()
            worker = self._workers.get(worker_id)
            if worker is None:
                continue
            pending = worker.pending
            gone = []
            for name in names:
                until = pending.get(name)
                if until is not None and until <= now:
                    del pending[name]
                    gone.append(name)
            self._unset(worker, gone)

    def load(self, snapshot: KvSnapshot) -> bool:
        """Rebuild a worker from its snapshot, unless what is applied already is newer."""
        worker = self._workers.get(snapshot.worker_id)
        if worker is not None and worker.seq is not None and worker.seq >= snapshot.seq:
            return False
        worker = self._fresh(snapshot.worker_id, snapshot.model, snapshot.block_size)
        self._set(worker, worker.blocks.load(snapshot.blocks))
        worker.seq = snapshot.seq
        return True

    def drop(self, worker_id: str) -> None:
        """Forget a worker (dead, or gone) and every block it held."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._forget_blocks(worker)
        self._forget_mask(worker.blocks.model, worker_id)
        self._free_bits.append(worker.bit)

    # ------------------------------------------------------------------ internals

    def _fresh(self, worker_id: str, model: str, block_size: int) -> _Worker:
        """The worker with no blocks (a new one, or one starting over)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._forget_blocks(worker)
            self._forget_mask(worker.blocks.model, worker_id)
        known = self._block_size.setdefault(model, block_size)
        if known != block_size:
            log.warning(
                "worker %s of %s has %d-token KV blocks, other workers %d: its blocks are "
                "not matched",
                worker_id,
                model,
                block_size,
                known,
            )
        bit = worker.bit if worker is not None else self._new_bit()
        fresh = _Worker(bit, EngineBlockMap(model, block_size), 0)
        self._workers[worker_id] = fresh
        self._masks.setdefault(model, {})[worker_id] = 1 << bit
        return fresh

    def _forget_blocks(self, worker: _Worker) -> None:
        """The worker holds nothing any more: neither stored blocks nor announced ones."""
        self._unset(worker, worker.blocks.clear() + list(worker.pending))
        worker.pending.clear()

    def _forget_mask(self, model: str, worker_id: str) -> None:
        """The worker no longer counts for ``model``. The model's block size is its
        remaining workers' when they agree (workers of another engine may have replaced
        the ones that set it), and unknown with none left."""
        masks = self._masks.get(model, {})
        masks.pop(worker_id, None)
        sizes = {self._workers[w].blocks.block_size for w in masks if w in self._workers}
        if len(sizes) == 1:
            self._block_size[model] = sizes.pop()
        elif not masks:
            self._masks.pop(model, None)
            self._block_size.pop(model, None)

    def _new_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        return len(self._workers)

    def _apply_event(self, worker: _Worker, event: KvEvent) -> None:
        added, removed = worker.blocks.apply(event)
        self._unset(worker, removed)
        if worker.pending:  # stored now: no longer a claim that expires
            for name in added:
                worker.pending.pop(name, None)
        self._set(worker, added)

    def _set(self, worker: _Worker, names: list[int]) -> None:
        mask = 1 << worker.bit
        holders = self._holders
        for name in names:
            current = holders.get(name, 0)  # 0: not held (a held block's mask is positive)
            if not current and len(holders) >= self.max_blocks:
                self._full()
                continue
            holders[name] = current | mask

    def _full(self) -> None:
        self.not_indexed += 1
        if not self._full_logged:
            self._full_logged = True
            log.warning(
                "prefix index full (%d blocks): new blocks are not indexed (raise "
                "CONVEYOR_PLACEMENT_INDEX_MAX_BLOCKS)",
                self.max_blocks,
            )

    def _unset(self, worker: _Worker, names: list[int]) -> None:
        keep = ~(1 << worker.bit)
        holders = self._holders
        for name in names:
            current = holders.get(name, 0)
            if not current:
                continue
            current &= keep
            if current:
                holders[name] = current
            else:
                del holders[name]


def _record(matched: dict[str, int], masks: dict[str, int], dropped: int, depth: int) -> None:
    if not depth:
        return
    for worker_id, mask in masks.items():
        if dropped & mask:
            matched[worker_id] = depth
