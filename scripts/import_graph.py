"""The import graph of python/aieng: modules, arrows, arrows that point up the layering, cycles.

    .venv/bin/python scripts/import_graph.py [--root python/aieng] [--show]

Every `import aieng...` and `from aieng... import ...` counts, wherever it is written (inside a
function or under `if TYPE_CHECKING:` too), as import-linter counts them. The layers are read
from the import-linter contract in pyproject.toml (the one named "layers"), so the figures are
those of the contract `lint-imports` checks; `--root` points at another checkout (e.g. an older
commit in a git worktree) to measure it against the same layering.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def module_names(package: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports (a name imported from a package is
    the submodule when there is one)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # `from aieng.x import y` also names aieng.x; keep the package only when nothing below it
    # was meant (the submodule arrow is the real one).
    return {t for t in found if not any(o.startswith(t + ".") for o in found) or t == package}


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer (0 = top) holding `module` or a package above it."""
    best: tuple[int, int] | None = None
    for index, members in enumerate(layers):
        for member in members:
            if module == member or module.startswith(member + "."):
                depth = member.count(".")
                if best is None or depth > best[1]:
                    best = (index, depth)
    return None if best is None else best[0]


def contract_layers(pyproject: Path) -> list[list[str]]:
    config = tomllib.loads(pyproject.read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [[m.strip() for m in re.split(r"[|:]", line)] for line in contract["layers"]]
    raise SystemExit("no layers contract in pyproject.toml")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT / "python" / "aieng")
    ap.add_argument("--show", action="store_true", help="list the upward arrows and the cycles")
    args = ap.parse_args()
    names = module_names(args.root)
    stub = args.root / "_core.pyi"
    if stub.exists():  # the Rust module: a compiled file, its stub the source to read
        names[f"{args.root.name}._core"] = stub
    known = set(names)
    graph = {name: imports_of(name, path, known) for name, path in names.items()}
    layers = contract_layers(ROOT / "pyproject.toml")
    arrows = [(a, b) for a, targets in graph.items() for b in sorted(targets)]
    upward = []
    for a, b in arrows:
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if la is not None and lb is not None and lb < la:
            upward.append((a, b))
    found = cycles(graph)
    unplaced = sorted(n for n in names if layer_of(n, layers) is None)
    lines = defaultdict(int)
    for n in names:
        lines[layer_of(n, layers)] += 1
    print(f"| {args.root} | count |\n|---|---|")
    print(f"| modules | {len(names)} |")
    print(f"| layers in the contract | {len(layers)} |")
    print(f"| import arrows | {len(arrows)} |")
    print(f"| arrows pointing up the layers | {len(upward)} |")
    print(f"| import cycles | {len(found)} (largest {max(map(len, found), default=0)} modules) |")
    print(f"| modules in no layer | {len(unplaced)} |")
    if args.show:
        for a, b in upward:
            print(f"up: {a} -> {b}")
        for component in found:
            print("cycle:", ", ".join(component))
        for name in unplaced:
            print("unplaced:", name)


if __name__ == "__main__":
    main()
