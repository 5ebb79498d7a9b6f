"""Check that imports only run down the layers: shared < workers.engines < workers < gateway
< conveyor.

Parses every module of those packages with :mod:`ast` (imports inside functions and
``TYPE_CHECKING`` blocks count too), prints which layer imports which, and exits 1
listing each import that runs back up a layer (or sideways into a layer of the same
rank). ``tests``, ``bench`` and ``scripts`` may import anything and are not checked.

    python scripts/import_graph.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

LAYERS = ("shared", "workers.engines", "workers", "gateway", "conveyor")
"""Lowest first: a module may import its own layer and the layers before it."""


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (the longest matching prefix)."""
    matches = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len, default=None)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
            found.append((base, node.lineno))
    return found


def edges(root: Path) -> list[Edge]:
    found: list[Edge] = []
    for top in {layer.split(".")[0] for layer in LAYERS}:
        for path in sorted((root / top).rglob("*.py")):
            source = module_name(root, path)
            tree = ast.parse(path.read_text(), filename=str(path))
            seen: set[tuple[str, int]] = set()
            for target, line in imported_modules(tree, source, path.name == "__init__.py"):
                target_layer = layer_of(target)
                if target_layer is None or (target_layer, line) in seen:
                    continue
                seen.add((target_layer, line))
                found.append(Edge(source, target, path, line))
    return found


def violations(found: list[Edge]) -> list[Edge]:
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    bad = []
    for edge in found:
        source, target = layer_of(edge.source), layer_of(edge.target)
        if source is None or target is None or source == target:
            continue
        if rank[target] > rank[source]:
            bad.append(edge)
    return bad


def summary(found: list[Edge]) -> list[str]:
    counts = Counter((layer_of(e.source), layer_of(e.target)) for e in found)
    lines = [f"layers, lowest first: {' < '.join(LAYERS)}"]
    for layer in LAYERS:
        targets = [
            f"{target} ({counts[(layer, target)]})"
            for target in LAYERS
            if target != layer and counts[(layer, target)]
        ]
        lines.append(f"  {layer:<16} imports {', '.join(targets) or 'nothing of the others'}")
    return lines


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = edges(root)
    print("\n".join(summary(found)))
    bad = violations(found)
    for edge in bad:
        where = edge.path.relative_to(root)
        print(
            f"UPWARD IMPORT {where}:{edge.line}: {edge.source} ({layer_of(edge.source)}) "
            f"imports {edge.target} ({layer_of(edge.target)})"
        )
    print(f"{len(bad)} upward import(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
