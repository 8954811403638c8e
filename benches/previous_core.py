"""The Rust core of a previous release, built beside this checkout for bench_core.py and
core_step_instructions.py: the previous-release row that shows the next regression.

The crate of `commit` (default PREVIOUS, the last milestone's release commit) is exported with
`git archive` into target/previous-core/<commit>/src and built there (release, the `python`
feature, one job unless CARGO_BUILD_JOBS says otherwise) into its own target folder; the
extension is copied to target/previous-core/<commit>/_core.abi3.so, importable as `_core` from
that folder. Its target folder starts as a copy of this checkout's target/release, so only the
dependencies that differ are compiled again. Later calls reuse the extension.

    .venv/bin/python benches/previous_core.py [--commit e346e0b]   # prints the folder
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = "e346e0b"  # bench_core: 16.2 µs p50 at 256 running, block size 16 (its own record)


def build(commit: str = PREVIOUS) -> Path:
    """The folder holding the previous core's `_core.abi3.so` (built on first use)."""
    full = git("rev-parse", f"{commit}^{{commit}}").strip()
    home = ROOT / "target" / "previous-core" / full[:12]
    module = home / "_core.abi3.so"
    if module.exists():
        return home
    src = home / "src"
    if not (src / "Cargo.toml").exists():
        archive = subprocess.run(
            ["git", "archive", full, "Cargo.toml", "Cargo.lock", "rust"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
    release, seeded = ROOT / "target" / "release", home / "target" / "release"
    if release.is_dir() and not seeded.exists():
        # This checkout's compiled dependencies: cargo rebuilds only what differs.
        shutil.copytree(release, seeded, symlinks=True, ignore=shutil.ignore_patterns("lib_core*"))
    env = dict(os.environ, PYO3_PYTHON=sys.executable)
    env.setdefault("CARGO_BUILD_JOBS", "1")
    command = ["nice", "-n", "5", "cargo", "build", "--release", "--features", "python", "--lib"]
    target = ["--target-dir", str(home / "target"), "--quiet"]
    subprocess.run([*command, *target], cwd=src, env=env, check=True)
    built = home / "target" / "release" / "lib_core.so"
    module.write_bytes(built.read_bytes())
    return home


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=PREVIOUS)
    print(build(ap.parse_args().commit))


if __name__ == "__main__":
    main()
