"""The package's import graph keeps the layering of docs/design.md: no arrow points up the
layers of pyproject.toml's import-linter contract, no module imports itself round a cycle, and
every module has a layer (a new module must be placed, or lint-imports would not check it)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402

PACKAGE = ROOT / "python" / "aieng"


@pytest.fixture(scope="module")
def graph():
    names = import_graph.module_names(PACKAGE)
    known = set(names) | {"aieng._core"}
    return names, {n: import_graph.imports_of(n, p, known) for n, p in names.items()}


def test_no_module_is_in_an_import_cycle(graph):
    _, imports = graph
    assert import_graph.cycles(imports) == []


def test_no_import_points_up_the_layers(graph):
    _, imports = graph
    layers = import_graph.contract_layers(ROOT / "pyproject.toml")
    upward = [
        (a, b)
        for a, targets in imports.items()
        for b in targets
        if (la := import_graph.layer_of(a, layers)) is not None
        and (lb := import_graph.layer_of(b, layers)) is not None
        and lb < la
    ]
    assert upward == []


def test_every_module_has_a_layer(graph):
    names, _ = graph
    layers = import_graph.contract_layers(ROOT / "pyproject.toml")
    unplaced = sorted(n for n in names if import_graph.layer_of(n, layers) is None)
    # The root package, `aieng`, is the public facade over every layer: import-linter's root.
    assert unplaced == ["aieng"], unplaced


def test_each_layer_is_whole_packages():
    """The contract names packages (and the top level's public modules), never a module inside
    a package: a package's modules share its layer."""
    layers = import_graph.contract_layers(ROOT / "pyproject.toml")
    members = [member for layer in layers for member in layer]
    assert all(member.count(".") == 1 for member in members), members
    assert len(layers) <= 15, len(layers)


def test_the_graph_counts_a_type_only_import_as_an_arrow(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n"
    )
    (package / "high.py").write_text("from pkg.low import Y\n")
    names = import_graph.module_names(package)
    imports = {n: import_graph.imports_of(n, p, set(names)) for n, p in names.items()}
    assert import_graph.cycles(imports) == [["pkg.high", "pkg.low"]]


def test_lint_imports_keeps_the_contracts():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout
