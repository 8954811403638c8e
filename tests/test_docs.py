"""The documentation holds to the code: the generated tables (engine options, metrics) are
current, and every relative link of README.md reaches a file. (`mkdocs build --strict` in
scripts/test.sh checks the links, anchors and nav of docs/ itself.)"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_docs_tables", ROOT / "scripts" / "gen_docs_tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current(capsys):
    assert load_generator().main(["--check"]) == 0, capsys.readouterr().out


def test_a_stale_table_is_caught(tmp_path, monkeypatch):
    gen = load_generator()
    for page in ("usage.md", "operations.md"):
        text = (ROOT / "docs" / page).read_text()
        (tmp_path / page).write_text(text.replace("| `max_num_seqs` |", "| `max_seqs` |"))
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0  # rewrites it
    assert gen.main(["--check"]) == 0
    assert (tmp_path / "usage.md").read_text() == (ROOT / "docs" / "usage.md").read_text()


def test_every_metric_the_server_exports_is_in_the_table():
    from aieng.server.metrics import ServerMetrics

    table = load_generator().metrics_table()
    metrics = ServerMetrics("model", stats=lambda: None)
    for family in metrics.registry.collect():
        if not family.name.startswith("process_"):
            assert f"`{family.name}" in table, family.name


def test_readme_links_reach_files():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    relative = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in relative)
    for link in relative:
        assert (ROOT / link).exists(), link
