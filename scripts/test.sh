#!/usr/bin/env bash
# The project's whole check: lint, Rust unit tests, the docs site, the Python test suite.
# Run it through the README's test command, which first installs into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv/bin
export PYO3_PYTHON="$PWD/$venv/python"

# The KJV corpus test reads Debian's bible-kjv; install it where this machine can.
if ! command -v bible >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "== apt-get install bible-kjv (for the KJV corpus test)"
    apt-get install -y -q bible-kjv >/dev/null 2>&1 \
        || echo "   (could not install bible-kjv: the KJV corpus test will skip)"
fi

# The monitoring tests run Debian's Prometheus (promtool and a real server); in CI they fail
# without it, so install it where this machine can.
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "== apt-get install prometheus (for the monitoring tests)"
    apt-get install -y -q prometheus >/dev/null 2>&1 \
        || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q prometheus >/dev/null 2>&1) \
        || echo "   (could not install prometheus: the monitoring tests will fail in CI)"
fi

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy -D warnings (core, and with the Python bindings)"
cargo clippy --all-targets --quiet -- -D warnings
cargo clippy --features python --quiet -- -D warnings
echo "== cargo test"
cargo test --quiet
echo "== ruff"
"$venv/ruff" check python tests benches scripts examples
"$venv/ruff" format --check python tests benches scripts examples
echo "== lint-imports (the layers of docs/design.md, no import cycles)"
"$venv/lint-imports"
echo "== mkdocs build --strict"
"$venv/mkdocs" build --strict --site-dir "$(mktemp -d)"
echo "== pytest"
"$venv/python" -m pytest -q "$@"
