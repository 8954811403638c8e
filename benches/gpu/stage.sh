#!/usr/bin/env bash
# Stages .whl/ (git-ignored) for the device run, on the machine with Rust:
#
#     PYTHON=.venv/bin/python bash benches/gpu/stage.sh
#
# The abi3 wheel alone (`maturin build --release`, reusing target/), GPU.md's step 1. Nothing
# else travels: the GPU host has pytest, torch, transformers, numpy and cuda-python, and a second
# copy of any of them would shadow the host's (and pytest's plugins); run.sh refuses such a
# wheel. Carry .whl to the device (the run tool's `carry: [".whl"]`, under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
maturin="$(dirname "$PYTHON")/maturin"
[[ -x "$maturin" ]] || maturin="$(command -v maturin)"

rm -rf .whl
mkdir -p .whl
"$maturin" build --release --out .whl --interpreter "$PYTHON"
ls -l .whl
du -sh .whl
