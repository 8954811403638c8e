#!/usr/bin/env bash
# Stages .whl/ (git-ignored) for the device run, on the machine with Rust and network:
#
#     PYTHON=.venv/bin/python bash benches/gpu/stage.sh
#
# 1. the abi3 wheel, `maturin build --release` (reusing target/), GPU.md's step 1;
# 2. the pure-Python wheels the GPU host lacks for run.sh's test parts (pytest and what it needs
#    that torch and transformers do not bring), at the versions this interpreter has, for
#    Python 3.12.
# run.sh installs them all with --no-index --no-deps. Carry .whl to the device (the run tool's
# `carry: [".whl"]`, under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
maturin="$(dirname "$PYTHON")/maturin"
[[ -x "$maturin" ]] || maturin="$(command -v maturin)"

rm -rf .whl
mkdir -p .whl
"$maturin" build --release --out .whl --interpreter "$PYTHON"
mapfile -t pins < <("$PYTHON" - <<'PY'
from importlib.metadata import version
for name in ("pytest", "pluggy", "iniconfig", "pygments"):
    print(f"{name}=={version(name)}")
PY
)
"$PYTHON" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 -d .whl "${pins[@]}"
ls -l .whl
du -sh .whl
