#!/usr/bin/env bash
# The project's whole check: lint, Rust unit tests, the Python test suite.
# Run it through the README's test command, which first installs into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv/bin
export PYO3_PYTHON="$PWD/$venv/python"

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy -D warnings (core, and with the Python bindings)"
cargo clippy --all-targets --quiet -- -D warnings
cargo clippy --features python --quiet -- -D warnings
echo "== cargo test"
cargo test --quiet
echo "== ruff"
"$venv/ruff" check python tests benches
"$venv/ruff" format --check python tests benches
echo "== pytest"
"$venv/python" -m pytest -q "$@"
