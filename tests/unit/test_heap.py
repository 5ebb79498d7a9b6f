"""The start-up heap leaves the garbage collector's reach."""

from __future__ import annotations

import gc

from shared.heap import freeze_startup_heap


def test_objects_alive_at_start_up_are_frozen() -> None:
    kept = [object() for _ in range(10)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
