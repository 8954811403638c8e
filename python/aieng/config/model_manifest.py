"""A versioned model: a Hugging Face checkpoint folder plus `aieng-model.json`, which says what the
model is and what it promises.

    {
      "name": "kjv-writer",
      "version": "1.2.0-data-v3",             # semantic: MAJOR.MINOR.PATCH[-QUALIFIER]
      "input_schema":  {JSON Schema of the request fields the model accepts},
      "output_schema": {JSON Schema of the response fields it returns},
      "requirements": {"memory_bytes": 2000000000, "device": "cpu"}   # device: cpu | cuda | any
    }

A version with a qualifier is a pre-release (semantic versioning's rule): "latest stable" skips
it. Every problem is a `ManifestError` naming the file and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "aieng-model.json"
DEVICES = ("cpu", "cuda", "any")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)


class ManifestError(ValueError):
    """An aieng-model.json that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, order=False)
class Version:
    major: int
    minor: int
    patch: int
    qualifier: str = ""

    @classmethod
    def parse(cls, text: str) -> Version:
        match = _SEMVER.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a version MAJOR.MINOR.PATCH[-QUALIFIER]")
        major, minor, patch, qualifier = match.groups()
        return cls(int(major), int(minor), int(patch), qualifier or "")

    @property
    def stable(self) -> bool:
        return not self.qualifier

    def sort_key(self) -> tuple:
        """Semantic versioning's precedence: a pre-release sorts before its release;
        qualifiers compare by dot-separated parts, numbers numerically and below words."""
        parts = tuple(
            (0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.qualifier.split(".")
        )
        return (self.major, self.minor, self.patch, not self.qualifier, parts)

    def __str__(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return f"{core}-{self.qualifier}" if self.qualifier else core


@dataclass(frozen=True)
class Requirements:
    memory_bytes: int = 0
    device: str = "any"


@dataclass(frozen=True)
class ModelManifest:
    name: str
    version: Version
    input_schema: dict[str, Any] = field(default_factory=dict)
    output_schema: dict[str, Any] = field(default_factory=dict)
    requirements: Requirements = field(default_factory=Requirements)
    folder: Path | None = None  # the checkpoint folder, when read from one

    @classmethod
    def load(cls, path: str | Path) -> ModelManifest:
        """`path`: a model folder holding aieng-model.json, or the manifest file itself."""
        path = Path(path)
        file = path / MANIFEST if path.is_dir() else path
        if not file.is_file():
            raise ManifestError(f"{file}: not found (a versioned model folder holds {MANIFEST})")
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{file}: cannot read JSON: {e}") from e
        return cls.from_dict(raw, str(file), file.parent if path.is_dir() else None)

    @classmethod
    def from_dict(
        cls, raw: Any, source: str = MANIFEST, folder: Path | None = None
    ) -> ModelManifest:
        if not isinstance(raw, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        name = raw.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ManifestError(
                f"{source}: field 'name' must be letters, digits, '.', '_' or '-', got {name!r}"
            )
        try:
            version = Version.parse(raw.get("version"))
        except ValueError as e:
            raise ManifestError(f"{source}: field 'version': {e}") from None
        schemas = {}
        for key in ("input_schema", "output_schema"):
            schema = raw.get(key, {})
            if not isinstance(schema, dict):
                raise ManifestError(f"{source}: field '{key}' must be a JSON Schema object")
            schemas[key] = schema
        return cls(
            name=name,
            version=version,
            requirements=_requirements(raw.get("requirements", {}), source),
            folder=folder,
            **schemas,
        )

    @property
    def ref(self) -> str:
        """`name@version`, as a request's `model` field names this version."""
        return f"{self.name}@{self.version}"


def _requirements(raw: Any, source: str) -> Requirements:
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: field 'requirements' must be an object")
    memory = raw.get("memory_bytes", 0)
    if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
        raise ManifestError(
            f"{source}: field 'requirements.memory_bytes' must be a non-negative integer, "
            f"got {memory!r}"
        )
    device = raw.get("device", "any")
    if device not in DEVICES:
        raise ManifestError(
            f"{source}: field 'requirements.device' must be one of {', '.join(DEVICES)}, "
            f"got {device!r}"
        )
    return Requirements(memory, device)
