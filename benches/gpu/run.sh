#!/usr/bin/env bash
# The one prepared GPU command (../shared/GPU.md), run from anywhere on the GPU host:
#
#     OUT=/some/dir bash benches/gpu/run.sh
#
# 1. installs the abi3 wheel built elsewhere (.whl/*.whl, `maturin build --release -o .whl`)
#    into a fresh site dir, with no network and no dependencies (the host has torch, cuda-python);
# 2. records the machine (nvidia-smi, versions);
# 3. runs every GPU test, tests/test_cuda_*gpu.py, and the CPU compile checks;
# 4. runs every benchmark benches/gpu/bench_*.py with `--out "$OUT"` (each writes its tables to
#    $OUT and to benches/results/).
# Logs go to $OUT. The exit status is non-zero if any step failed; every step runs regardless.
# To fit a short device lease, TESTS (pytest arguments, default below) and BENCHES (files; "none"
# for no benchmark) narrow the run, e.g. BENCHES=benches/gpu/bench_attention.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
status=0

SITE="$(mktemp -d)"
wheels=(.whl/*.whl)
if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheel in .whl/: build one with 'maturin build --release -o .whl' first" | tee "$OUT/run.log"
    exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" 2>&1 | tee "$OUT/install.log"
export PYTHONPATH="$SITE"
export AIENG_CACHE_DIR="$SITE/aieng-cache"  # compile every kernel afresh, on this host's NVRTC

{
    date -u
    nvidia-smi || true
    "$PYTHON" - <<'PY'
import aieng, torch
from cuda.bindings import nvrtc
print("aieng from", aieng.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
print("capability", torch.cuda.get_device_capability(), "nvrtc", nvrtc.nvrtcVersion()[1:])
PY
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

read -r -a tests <<< "${TESTS:-tests/test_cuda_compile.py $(echo tests/test_cuda_*gpu.py)}"
"$PYTHON" -m pytest -q -p no:cacheprovider -rs "${tests[@]}" \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

read -r -a benches <<< "${BENCHES:-$(echo benches/gpu/bench_*.py)}"
[[ "${benches[*]}" == none ]] && benches=()
for bench in "${benches[@]}"; do
    name="$(basename "$bench" .py)"
    "$PYTHON" "$bench" --out "$OUT" 2>&1 | tee "$OUT/$name.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
done
echo "run.sh finished with status $status; logs and tables in $OUT"
exit $status
