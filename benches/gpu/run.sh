#!/usr/bin/env bash
# The GPU device run, one part per command (../shared/GPU.md; benches/gpu/README.md):
#
#     OUT=/some/dir bash benches/gpu/run.sh PART [ARGS...]   # no PART: the parts, their budgets
#
# ARGS go to pytest (test parts) or to the bench (bench parts), to narrow a part that overruns.
#
# Every part:
# 1. stops at once (exit 3) when torch sees no GPU — nothing is ever "passed" on a CPU;
# 2. installs the abi3 wheel built elsewhere (.whl/aieng-*.whl: benches/gpu/stage.sh puts it there;
#    the other wheels there are pytest's, which the host lacks) with no network and no dependencies,
#    once per wheel into ${TMPDIR:-/tmp}/aieng-site-<wheel hash>, which later parts on the same
#    machine reuse with its NVRTC kernel cache (compiled afresh on this host);
# 3. records the machine (nvidia-smi, versions) and runs, under a time limit (PART_LIMIT_S,
#    default 470 s), what the part names; logs and tables go to $OUT/PART/;
# 4. prints its wall time and exits non-zero when anything failed, a test skipped, or a
#    benchmark's kernel path was not the one it claims (the benches check that themselves).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"

# part -> what it runs, and its expected minutes on an H200 (estimates until measured there)
declare -A ABOUT=(
    [tests]="kernel GPU tests (attention, int4, fused) and the NVRTC compile checks, no skips"
    [engine-tests]="GPU tests that load engines: fused ops in models, CUDA graphs, no skips"
    [attention]="bench_attention: decode attention vs copy bandwidth, torch and SDPA"
    [int4]="bench_int4: INT4 GEMV/GEMM vs copy bandwidth and torch fp16"
    [e2e]="bench_e2e: Qwen3-0.6B shape, 256 requests, bf16 and INT4, kernels vs reference slice"
    [sanitizer]="compute-sanitizer memcheck over every kernel, racecheck over attention"
)
declare -A MINUTES=([tests]=4 [engine-tests]=4 [attention]=3 [int4]=2 [e2e]=6 [sanitizer]=5)
ORDER=(tests attention int4 e2e sanitizer engine-tests)
# GPU tests that build engines (slow): their own part; every other tests/test_cuda_*gpu.py is
# a kernel test.
ENGINE_TESTS=(tests/test_cuda_fused_model_gpu.py tests/test_cuda_graphs_gpu.py)

usage() {
    echo "usage: OUT=DIR bash benches/gpu/run.sh PART [ARGS for pytest or the bench]"
    echo "(each part <= 8 minutes on an H200)"
    echo "parts, in the order to run them in a short lease (minutes are estimates):"
    for part in "${ORDER[@]}"; do
        printf "  %-13s ~%s min  %s\n" "$part" "${MINUTES[$part]}" "${ABOUT[$part]}"
    done
}

part="${1:-}"
if [[ -z "$part" ]]; then
    usage
    exit 2
fi
if [[ -z "${ABOUT[$part]+x}" ]]; then
    echo "run.sh: unknown part '$part'" >&2
    usage >&2
    exit 2
fi
OUT="${OUT:-$(mktemp -d)}"
PART_OUT="$OUT/$part"
mkdir -p "$PART_OUT"
LIMIT="${PART_LIMIT_S:-470}"
started=$SECONDS

finish() {
    local status=$1
    local wall=$((SECONDS - started))
    echo "run.sh $part: status $status, wall ${wall} s; logs and tables in $PART_OUT" |
        tee -a "$PART_OUT/run.log"
    echo "$status $wall" > "$PART_OUT/status"
    exit "$status"
}

# 1. a GPU, or nothing
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' \
    > "$PART_OUT/gpu_check.log" 2>&1; then
    echo "run.sh $part: no GPU visible (torch.cuda.is_available() is False for $PYTHON); nothing ran" |
        tee "$PART_OUT/run.log" >&2
    cat "$PART_OUT/gpu_check.log" >&2
    finish 3
fi

# 2. the wheel, installed once per wheel
shopt -s nullglob
ours=(.whl/aieng-*.whl)
others=()
for wheel in .whl/*.whl; do
    [[ "$(basename "$wheel")" == aieng-* ]] || others+=("$wheel")
done
if [[ ${#ours[@]} -ne 1 ]]; then
    echo "run.sh $part: want exactly one .whl/aieng-*.whl, found ${#ours[@]}: build one with" \
        "'bash benches/gpu/stage.sh' (and carry .whl to the device)" | tee "$PART_OUT/run.log" >&2
    finish 2
fi
hash="$(cat "${ours[0]}" "${others[@]}" | sha256sum | cut -c1-16)"
SITE="${TMPDIR:-/tmp}/aieng-site-$hash"
if [[ ! -e "$SITE/.installed" ]]; then
    rm -rf "$SITE"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${ours[0]}" "${others[@]}" \
        > "$PART_OUT/install.log" 2>&1; then
        cat "$PART_OUT/install.log" >&2
        finish 2
    fi
    touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE"
export AIENG_CACHE_DIR="$SITE/aieng-cache"  # kernels compiled on this host's NVRTC, then reused

# 3. the machine
{
    date -u
    nvidia-smi || true
    "$PYTHON" - "$SITE" <<'PY'
import sys
import aieng, torch
from cuda.bindings import nvrtc
assert aieng.__file__.startswith(sys.argv[1]), f"aieng imported from {aieng.__file__}, not the wheel"
print("aieng from", aieng.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
print("capability", torch.cuda.get_device_capability(), "nvrtc", nvrtc.nvrtcVersion()[1:])
PY
} > "$PART_OUT/machine.txt" 2>&1 || { cat "$PART_OUT/machine.txt" >&2; finish 2; }
cat "$PART_OUT/machine.txt"

# 4. the part
deadline=$((started + LIMIT))
limited() {  # what is left of the part's time; SIGINT first: pytest still writes its junit xml
    local left=$((deadline - SECONDS))
    if ((left < 30)); then
        echo "run.sh $part: out of time (PART_LIMIT_S=$LIMIT) before: $*" >&2
        return 124
    fi
    timeout -s INT -k 30 "$left" "$@"
}

run_tests() {  # pytest FILES... -> fails on a failure, an error, a skip or no test at all
    limited "$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=15 "$@" \
        --junitxml="$PART_OUT/tests.xml" 2>&1 | tee "$PART_OUT/tests.log"
    local status=${PIPESTATUS[0]}
    "$PYTHON" benches/gpu/junit_summary.py "$PART_OUT/tests.xml" | tee -a "$PART_OUT/tests.log"
    local summary=${PIPESTATUS[0]}
    [[ $status -eq 0 && $summary -eq 0 ]]
}

run_bench() {  # bench_X.py ARGS... -> its own status (non-zero when its kernel path was not run)
    local name
    name="$(basename "$1" .py)"
    limited "$PYTHON" "$@" --out "$PART_OUT" 2>&1 | tee "$PART_OUT/$name.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]]
}

sanitizer() {
    local tool
    tool="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    if [[ ! -x "$tool" ]]; then
        echo "run.sh sanitizer: compute-sanitizer not found" >&2
        return 1
    fi
    # every allocation its own: out-of-bounds accesses inside torch's cached blocks show
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    local args=(--error-exitcode 1 --target-processes all --report-api-errors no --print-limit 50)
    local status=0
    limited "$tool" --tool memcheck "${args[@]}" "$PYTHON" benches/gpu/sanitize_kernels.py \
        2>&1 | tee "$PART_OUT/memcheck.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    limited "$tool" --tool racecheck "${args[@]}" "$PYTHON" benches/gpu/sanitize_kernels.py \
        --kernels attention --dtypes bfloat16 --attention-models 2 2>&1 | tee "$PART_OUT/racecheck.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    return $status
}

kernel_tests() {  # ARGS... -> pytest's extra arguments
    local files=(tests/test_cuda_compile.py)
    for file in tests/test_cuda_*gpu.py; do
        [[ " ${ENGINE_TESTS[*]} " == *" $file "* ]] || files+=("$file")
    done
    run_tests "${files[@]}" "$@"
}

extra=("${@:2}")  # handed to pytest or the bench, e.g. `e2e --formats bfloat16`, `tests -k int4`
case "$part" in
    tests) kernel_tests "${extra[@]}" ;;
    engine-tests) run_tests "${ENGINE_TESTS[@]}" "${extra[@]}" ;;
    attention) run_bench benches/gpu/bench_attention.py "${extra[@]}" ;;
    int4) run_bench benches/gpu/bench_int4.py "${extra[@]}" ;;
    e2e) run_bench benches/gpu/bench_e2e.py "${extra[@]}" ;;
    sanitizer) sanitizer ;;
esac
finish $(($? == 0 ? 0 : 1))
