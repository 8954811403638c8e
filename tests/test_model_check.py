"""Versioned models: aieng-model.json, semantic versions, and `aieng model check OLD NEW` as a CI
gate (exit 0 compatible, 1 with the list of breaking changes, 2 for an unreadable manifest)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aieng.cli import main
from aieng.config.model_manifest import ManifestError, ModelManifest, Version
from aieng.config.schema_compat import input_problems, output_problems

OUTPUT = {
    "type": "object",
    "required": ["text", "finish_reason"],
    "properties": {
        "text": {"type": "string"},
        "finish_reason": {"type": "string", "enum": ["stop", "length"]},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "usage": {
            "type": "object",
            "properties": {"prompt": {"type": "integer"}, "completion": {"type": "integer"}},
        },
    },
}
INPUT = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string"},
        "max_tokens": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "exact"]},
    },
}


def manifest(folder, version, output=OUTPUT, input_schema=INPUT, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "name": "kjv-writer",
        "version": version,
        "output_schema": output,
        "input_schema": input_schema,
        "requirements": {"memory_bytes": 1 << 30, "device": "cpu"},
        **extra,
    }
    (folder / "aieng-model.json").write_text(json.dumps(body))
    return folder


def changed(schema, path, value=None, remove=False):
    """A deep copy of `schema` with the node at `path` (keys) replaced or removed."""
    copy = json.loads(json.dumps(schema))
    node = copy
    for key in path[:-1]:
        node = node[key]
    if remove:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return copy


def test_versions_parse_and_order_as_semver():
    assert str(Version.parse("1.2.0-data-v3")) == "1.2.0-data-v3"
    assert not Version.parse("1.2.0-rc.1").stable and Version.parse("1.2.0").stable
    ordered = ["0.9.9", "1.0.0-alpha", "1.0.0-alpha.2", "1.0.0-alpha.10", "1.0.0-beta", "1.0.0"]
    keys = [Version.parse(v).sort_key() for v in ordered]
    assert keys == sorted(keys)
    for bad in ("1.2", "01.2.3", "1.2.3-", "v1.2.3", "1.2.3+build", None):
        with pytest.raises(ValueError, match=r"MAJOR\.MINOR\.PATCH"):
            Version.parse(bad)


def test_manifest_errors_name_the_field(tmp_path):
    good = json.loads((manifest(tmp_path / "m", "1.0.0") / "aieng-model.json").read_text())
    cases = {
        "name": ("bad name!", "field 'name'"),
        "version": ("1.0", "field 'version'"),
        "output_schema": ([], "field 'output_schema'"),
        "requirements": ({"device": "tpu"}, "field 'requirements.device'"),
    }
    for field, (value, message) in cases.items():
        with pytest.raises(ManifestError, match=message):
            ModelManifest.from_dict({**good, field: value})
    with pytest.raises(ManifestError, match="not found"):
        ModelManifest.load(tmp_path / "nowhere")
    loaded = ModelManifest.load(tmp_path / "m")
    assert loaded.ref == "kjv-writer@1.0.0" and loaded.folder == tmp_path / "m"
    assert loaded.requirements.memory_bytes == 1 << 30


def test_adding_output_fields_and_optional_inputs_is_compatible():
    output = changed(OUTPUT, ["properties", "latency_ms"], {"type": "number"})
    assert output_problems(OUTPUT, output) == []
    inputs = changed(INPUT, ["properties", "seed"], {"type": "integer"})
    assert input_problems(INPUT, inputs) == []
    # an input may widen: integer -> number, a longer enum
    wider = changed(INPUT, ["properties", "max_tokens", "type"], "number")
    wider = changed(wider, ["properties", "mode", "enum"], ["fast", "exact", "draft"])
    assert input_problems(INPUT, wider) == []


@pytest.mark.parametrize(
    "path, value, remove, expected",
    [
        (["properties", "text"], None, True, "text: removed"),
        (["properties", "tokens", "items", "type"], "string", False, "tokens[]: type 'string'"),
        (["properties", "usage", "properties", "prompt"], None, True, "usage.prompt: removed"),
        (["required"], ["text"], False, "finish_reason: no longer required"),
        (
            ["properties", "finish_reason", "enum"],
            ["stop", "length", "tool_calls"],
            False,
            "finish_reason: may now be a value outside",
        ),
        (["properties", "text", "type"], ["string", "null"], False, "text: type"),
    ],
)
def test_output_changes_that_break_readers(path, value, remove, expected):
    problems = output_problems(OUTPUT, changed(OUTPUT, path, value, remove))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (["required"], ["prompt", "max_tokens"], "max_tokens: newly required"),
        (["properties", "max_tokens", "type"], "string", "max_tokens: type 'string'"),
        (["properties", "mode", "enum"], ["fast"], "mode: no longer accepts"),
    ],
)
def test_input_changes_that_break_writers(path, value, expected):
    problems = input_problems(INPUT, changed(INPUT, path, value))
    assert any(expected in p for p in problems), problems
    closed = changed(
        changed(INPUT, ["additionalProperties"], False), ["properties", "mode"], remove=True
    )
    assert input_problems(INPUT, closed) == ["mode: removed (and extra fields are refused)"]


def test_model_check_is_a_ci_gate(tmp_path, capsys):
    old = manifest(tmp_path / "v1", "1.1.0")
    added = manifest(
        tmp_path / "v1.2", "1.2.0-data-v3", output=changed(OUTPUT, ["properties", "x"], {})
    )
    assert main(["model", "check", str(old), str(added)]) == 0
    assert "kjv-writer@1.1.0 -> kjv-writer@1.2.0-data-v3: compatible" in capsys.readouterr().out
    broken_output = changed(
        changed(OUTPUT, ["properties", "text"], remove=True),
        ["properties", "tokens", "items", "type"],
        "string",
    )
    broken = manifest(tmp_path / "v2", "2.0.0", output=broken_output)
    assert main(["model", "check", str(old), str(broken / "aieng-model.json")]) == 1
    out = capsys.readouterr().out
    assert "2 breaking change(s)" in out
    assert "output text: removed" in out and "output tokens[]: type 'string'" in out
    assert "major version was bumped" in out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "aieng-model.json").write_text("{")
    assert main(["model", "check", str(old), str(tmp_path / "bad")]) == 2
    assert "cannot read JSON" in capsys.readouterr().err


def test_model_check_through_the_installed_command(tmp_path):
    old = manifest(tmp_path / "a", "1.0.0")
    new = manifest(
        tmp_path / "b", "0.9.0", output=changed(OUTPUT, ["properties", "usage"], remove=True)
    )
    result = subprocess.run(
        [sys.executable, "-m", "aieng", "model", "check", str(old), str(new)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "output usage: removed" in result.stdout
    assert "note: 0.9.0 is not newer than 1.0.0" in result.stdout
