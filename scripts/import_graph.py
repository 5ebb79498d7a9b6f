"""Check that imports only run down the layers, and that no modules import each other.

Each layer is a package (or a root module) and names the layers directly below it; a
module may import its own layer and everything below it (the transitive closure), nothing
else. So the stages of a request read bottom-up: in the gateway, ``openai`` (pure wire
vocabulary) < ``catalog``/``control``/``db``/``placement`` < ``dispatch`` < ``images`` <
``serving`` < ``routes`` < ``app``; the gateway and the workers never import each other;
production code never imports the generated demo models (``shared.demo``: only the CLI
may).

Parses every module with :mod:`ast`. Imports inside functions count; imports under
``if TYPE_CHECKING:`` do not (they never run). Prints which layer imports which, then each
import that breaks the order, then each import circle between modules, and exits 1 if
there is either. ``tests``, ``bench`` and ``scripts`` may import anything and are not
checked.

    python scripts/import_graph.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BELOW: dict[str, tuple[str, ...]] = {
    "shared": (),
    "shared.demo": ("shared",),
    # workers: engines and the journal, the roles that drive them, the loop around them
    "workers": ("shared",),
    "workers.engines": ("shared",),
    "workers.journal": ("shared",),
    "workers.roles": ("workers.engines", "workers.journal"),
    "workers.intake": ("workers.roles",),
    "workers.health": ("workers.intake",),
    "workers.commands": ("workers.intake",),
    "workers.runtime": ("workers.intake",),
    "workers.assembly": ("workers.runtime", "workers.health", "workers.commands"),
    "workers.main": ("workers.assembly",),
    # gateway: the request's stages, bottom-up
    "gateway": ("shared",),
    "gateway.openai": ("shared",),
    "gateway.db": ("shared",),
    "gateway.catalog": ("gateway.openai",),
    "gateway.control": ("gateway.db",),
    "gateway.placement": ("shared",),
    "gateway.dispatch": ("gateway.catalog", "gateway.control", "gateway.placement"),
    "gateway.images": ("gateway.dispatch",),
    "gateway.metrics": ("gateway.images",),
    "gateway.state": ("gateway.metrics",),
    "gateway.body_limit": ("shared",),
    "gateway.error_handlers": ("gateway.state",),
    "gateway.auth": ("gateway.state",),
    "gateway.serving": ("gateway.state",),
    "gateway.routes": (
        "gateway.serving",
        "gateway.auth",
        "gateway.error_handlers",
        "gateway.body_limit",
    ),
    "gateway.edge_guard": ("gateway.auth", "gateway.error_handlers"),
    "gateway.app": ("gateway.routes", "gateway.edge_guard"),
    "gateway.server": ("gateway.app",),
    # the command line starts everything, and writes the demo models
    "conveyor": ("gateway.server", "workers.main", "shared.demo"),
}
"""Each layer and the layers directly below it."""

PACKAGES = ("shared", "workers", "gateway", "conveyor")


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int


@cache
def allowed(layer: str) -> frozenset[str]:
    """The layers ``layer`` may import: itself and everything below it."""
    found = {layer}
    for lower in BELOW[layer]:
        found |= allowed(lower)
    return frozenset(found)


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (the longest matching prefix)."""
    matches = [layer for layer in BELOW if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len, default=None)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for child in node.body for inner in ast.walk(child)}
    return skipped


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    skipped = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def modules(root: Path) -> dict[str, Path]:
    return {
        module_name(root, path): path
        for top in PACKAGES
        for path in sorted((root / top).rglob("*.py"))
    }


def edges(root: Path) -> list[Edge]:
    known = modules(root)
    found: list[Edge] = []
    for source, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        seen: set[tuple[str, int]] = set()
        for name, line in imported_modules(tree, source, path.name == "__init__.py"):
            target = _known_module(name, known)
            if target is None or target == source or (target, line) in seen:
                continue
            seen.add((target, line))
            found.append(Edge(source, target, path, line))
    return found


def _known_module(name: str, known: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (``a.b.Class`` -> ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def violations(found: list[Edge]) -> list[Edge]:
    bad = []
    for edge in found:
        source, target = layer_of(edge.source), layer_of(edge.target)
        if source is None or target is None:
            continue
        if target not in allowed(source):
            bad.append(edge)
    return bad


def circles(found: list[Edge]) -> list[list[str]]:
    """Import circles between modules (package ``__init__`` re-exports aside), each once."""
    graph: dict[str, set[str]] = {}
    for edge in found:
        if not edge.target.startswith(edge.source + "."):  # a package importing its own parts
            graph.setdefault(edge.source, set()).add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def summary(found: list[Edge]) -> list[str]:
    counts = Counter((layer_of(e.source), layer_of(e.target)) for e in found)
    lines = ["layers (each imports itself and what is below it):"]
    for layer in BELOW:
        targets = [
            f"{target} ({counts[(layer, target)]})"
            for target in BELOW
            if target != layer and counts[(layer, target)]
        ]
        lines.append(f"  {layer:<24} imports {', '.join(targets) or 'nothing of the others'}")
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
    loops = circles(found)
    for loop in loops:
        print(f"IMPORT CIRCLE: {' <-> '.join(loop)}")
    print(f"{len(loops)} import circle(s)")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
