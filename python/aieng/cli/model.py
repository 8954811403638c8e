"""`aieng model check OLD NEW`: may NEW replace OLD for OLD's clients? A CI gate.

OLD and NEW are versioned model folders (or their aieng-model.json files). Fields added to the
output schema pass; fields removed or retyped (and the other changes aieng.config.schema_compat
names) fail. Exit status: 0 compatible, 1 incompatible (each problem on its own line), 2 a manifest
that cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from aieng.config.model_manifest import ManifestError, ModelManifest
from aieng.config.schema_compat import input_problems, output_problems


def add_model(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="versioned models: compare two versions")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="may NEW replace OLD? exit 1 with the breaking changes if not",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("old", help="the serving version: a model folder or its aieng-model.json")
    check.add_argument("new", help="the candidate version")
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    try:
        old, new = ModelManifest.load(args.old), ModelManifest.load(args.new)
    except ManifestError as error:
        print(f"aieng model check: error: {error}", file=sys.stderr)
        return 2
    problems = [f"output {p}" for p in output_problems(old.output_schema, new.output_schema)]
    problems += [f"input {p}" for p in input_problems(old.input_schema, new.input_schema)]
    notes = []
    if old.name != new.name:
        notes.append(f"note: the names differ ({old.name} -> {new.name})")
    if new.version.sort_key() <= old.version.sort_key():
        notes.append(f"note: {new.version} is not newer than {old.version}")
    for note in notes:
        print(note)
    if problems:
        print(f"{old.ref} -> {new.ref}: {len(problems)} breaking change(s)")
        for problem in problems:
            print(f"  {problem}")
        if new.version.major > old.version.major:
            print("  (the major version was bumped, but clients of the old schemas still break)")
        return 1
    print(f"{old.ref} -> {new.ref}: compatible")
    return 0
