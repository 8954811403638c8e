"""Is a new version's JSON Schema compatible with the old one's, for the clients of the old?

Output schema (what clients read): a field may be added; a field removed, made optional (no
longer `required`), retyped (its set of types no longer within the old one's), or given values
the old enum did not allow breaks readers. Input schema (what clients send): a field may be
added if optional; a new required field, a retyped field (the new types must include the old
ones), a narrowed enum, or a removed field where extra fields are refused
(`additionalProperties: false`) breaks writers. Objects are compared property by
property and arrays by their `items`, recursively; each problem names the field's path.

This is the subset of JSON Schema that response and request shapes use (type, properties,
required, items, enum, additionalProperties); keywords outside it are not compared.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _types(schema: Schema) -> set[str] | None:
    """The schema's declared types (None: any). `integer` is within `number`."""
    declared = schema.get("type")
    if declared is None:
        return None
    types = {declared} if isinstance(declared, str) else set(declared)
    if "number" in types:
        types.add("integer")
    return types


def _within(inner: set[str] | None, outer: set[str] | None) -> bool:
    if outer is None:
        return True
    if inner is None:
        return False
    return inner <= outer


def _enum_within(inner: list | None, outer: list) -> bool:
    """Every value `inner` allows is one of `outer`'s (None: any value, so not within)."""
    if inner is None:
        return False
    allowed = [repr(v) for v in outer]
    return all(repr(v) in allowed for v in inner)


def output_problems(old: Schema, new: Schema, path: str = "") -> list[str]:
    """Why readers of `old` cannot read what `new` describes; [] if they can."""
    where = path or "(the response)"
    problems = []
    if not _within(_types(new), _types(old)):
        problems.append(f"{where}: type {new.get('type')!r} was {old.get('type')!r}")
        return problems
    if "enum" in old and not _enum_within(new.get("enum"), old["enum"]):
        problems.append(f"{where}: may now be a value outside {old['enum']!r}")
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    new_required = set(new.get("required", []))
    for name, old_field in old_props.items():
        field_path = f"{path}.{name}" if path else name
        if name not in new_props:
            problems.append(f"{field_path}: removed")
            continue
        if name in old.get("required", []) and name not in new_required:
            problems.append(f"{field_path}: no longer required (readers expect it)")
        problems += output_problems(old_field, new_props[name], field_path)
    if isinstance(old.get("items"), dict):
        problems += output_problems(old["items"], new.get("items", {}), f"{path}[]")
    return problems


def input_problems(old: Schema, new: Schema, path: str = "") -> list[str]:
    """Why requests written for `old` are not valid under `new`; [] if they are."""
    where = path or "(the request)"
    problems = []
    if not _within(_types(old), _types(new)):
        problems.append(f"{where}: type {new.get('type')!r} was {old.get('type')!r}")
        return problems
    if "enum" in new and not _enum_within(old.get("enum"), new["enum"]):
        problems.append(f"{where}: no longer accepts every value of {old.get('enum', 'any')!r}")
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    old_required = set(old.get("required", []))
    for name in new.get("required", []):
        if name not in old_required:
            problems.append(f"{f'{path}.{name}' if path else name}: newly required")
    for name, old_field in old_props.items():
        field_path = f"{path}.{name}" if path else name
        if name not in new_props:
            if new.get("additionalProperties") is False:
                problems.append(f"{field_path}: removed (and extra fields are refused)")
            continue
        problems += input_problems(old_field, new_props[name], field_path)
    if isinstance(old.get("items"), dict):
        problems += input_problems(old["items"], new.get("items", {}), f"{path}[]")
    return problems
