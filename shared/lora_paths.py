"""Where LoRA adapters may be loaded from: inside the configured roots
(``CONVEYOR_LORA_ROOTS``), judged on the path with every symlink resolved, so a link
inside a root that points out of it does not count. The gateway checks a path when it
is registered and every worker again before it reads a byte; neither says whether a
path outside the roots exists."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

OUTSIDE_ROOTS = (
    "path must be an adapter folder inside the LoRA roots this server allows (CONVEYOR_LORA_ROOTS)"
)


def resolve_in_roots(path: str, roots: Sequence[Path]) -> Path | None:
    """``path`` with symlinks resolved, if it is absolute and lies inside one of ``roots``
    (themselves resolved); None otherwise."""
    if not os.path.isabs(path) or "\x00" in path:
        return None
    real = Path(os.path.realpath(path))
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if real == real_root or real.is_relative_to(real_root):
            return real
    return None
