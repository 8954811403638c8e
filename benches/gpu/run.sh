#!/usr/bin/env bash
# The GPU device run, one part per command (../shared/GPU.md; benches/gpu/README.md):
#
#     OUT=/some/dir bash benches/gpu/run.sh PART [ARGS...]   # no PART: the parts, their limits
#
# ARGS go to pytest (test parts) or to the bench (attention, int4, e2e), to narrow a part.
#
# Every part:
# 1. stops at once (exit 3) when torch sees no GPU — nothing is ever "passed" on a CPU;
# 2. installs the abi3 wheel built elsewhere (.whl/aieng-*.whl, benches/gpu/stage.sh) with no
#    network and no dependencies, once per wheel into ${TMPDIR:-/tmp}/aieng-site-<wheel hash>,
#    which later parts on the same machine reuse with its NVRTC kernel cache; a wheel there of a
#    package the host already has (pytest, torch, ...) is refused: it would shadow the host's;
# 3. records the machine (nvidia-smi, versions) and runs, under its time limit (LIMIT_S below,
#    or PART_LIMIT_S), what the part names, in a scratch folder;
# 4. leaves exactly two files in $OUT, whatever it ran: PART.tar.gz (every log and table) and
#    PART.log (its summary: the machine, the junit summary or the tables, the status line),
#    because at most 8 files come back from a device command (GPU.md);
# 5. exits non-zero when anything failed, a test skipped, or a benchmark's kernel path was not
#    the one it claims (the benches check that themselves); its last line gives the wall time.
#
# RUN_SH_SMOKE=1 (CI, tests/test_gpu_bench_smoke.py): no GPU and no wheel (aieng from the
# caller's PYTHONPATH); the benches and the sanitizer driver run their --smoke modes without
# compute-sanitizer, and the test parts only collect their tests (no test can run on a CPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
SMOKE="${RUN_SH_SMOKE:-0}"

# part -> what it runs, and its time limit in seconds. A 15-minute lease (start-up included)
# runs tests, benches and sanitizer, in that order (11 minutes at most); the next lease
# engine-tests and e2e.
declare -A ABOUT=(
    [tests]="kernel GPU tests (attention, int4, fused): kernel correctness only, no engine"
    [benches]="bench_attention then bench_int4: kernels vs copy bandwidth and torch"
    [attention]="bench_attention alone: decode attention vs copy bandwidth, torch and SDPA"
    [int4]="bench_int4 alone: INT4 GEMV/GEMM vs copy bandwidth and torch fp16"
    [sanitizer]="compute-sanitizer memcheck, then racecheck, over the bf16 attention kernels"
    [engine-tests]="GPU tests that build engines (host transformers): models, CUDA graphs"
    [e2e]="bench_e2e: Qwen3-0.6B shape, 256 requests, bf16 and INT4, kernels vs reference"
)
declare -A LIMIT_S=(
    [tests]=240 [benches]=240 [attention]=150 [int4]=150 [sanitizer]=180
    [engine-tests]=300 [e2e]=420
)
ORDER=(tests benches sanitizer engine-tests e2e attention int4)
# GPU tests that build engines (checkpoints from the host's transformers): their own part; every
# other tests/test_cuda_*gpu.py is a kernel test and runs in `tests`.
ENGINE_TESTS=(
    tests/test_cuda_attention_engine_gpu.py
    tests/test_cuda_int4_engine_gpu.py
    tests/test_cuda_fused_model_gpu.py
    tests/test_cuda_graphs_gpu.py
)
# A start-up check's child process may go this long without reporting (per check) before its
# kernel counts as hung (aieng.kernels.check_child): well inside every part's limit.
export AIENG_CHECK_TIMEOUT_S="${AIENG_CHECK_TIMEOUT_S:-60}"
MAX_FILES=8  # what comes back from one device command ($OUT, two folders deep at most)

usage() {
    echo "usage: OUT=DIR bash benches/gpu/run.sh PART [ARGS for pytest or the bench]"
    echo "(start-up checks: ${AIENG_CHECK_TIMEOUT_S} s per check in their child process)"
    echo "parts, in the order to run them in a short lease (limits in seconds):"
    for part in "${ORDER[@]}"; do
        printf "  %-13s %4s s  %s\n" "$part" "${LIMIT_S[$part]}" "${ABOUT[$part]}"
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
mkdir -p "$OUT"
WORK="$(mktemp -d)"
PART_OUT="$WORK/$part"  # everything the part writes; packed into $OUT/$part.tar.gz at the end
mkdir -p "$PART_OUT"
SUMMARY="$PART_OUT/summary.log"
LIMIT="${PART_LIMIT_S:-${LIMIT_S[$part]}}"
started=$SECONDS

say() {  # a line for the summary (and the command's output)
    echo "$@" | tee -a "$SUMMARY"
}

finish() {
    local status=$1
    local wall=$((SECONDS - started))
    say "run.sh $part: status $status, wall ${wall} s (limit ${LIMIT} s); logs and tables in" \
        "$OUT/$part.tar.gz"
    echo "$status $wall" > "$PART_OUT/status"
    tar -czf "$OUT/$part.tar.gz" -C "$WORK" "$part"
    cp "$SUMMARY" "$OUT/$part.log"
    rm -rf "$WORK"
    local files
    files=$(find "$OUT" -type f | wc -l)
    if ((files > MAX_FILES)); then
        echo "run.sh: WARNING: $OUT holds $files files; only $MAX_FILES come back" >&2
    fi
    exit "$status"
}

# 1. a GPU, or nothing
if [[ "$SMOKE" != 1 ]] &&
    ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' \
        > "$PART_OUT/gpu_check.log" 2>&1; then
    say "run.sh $part: no GPU visible (torch.cuda.is_available() is False for $PYTHON); nothing ran" >&2
    cat "$PART_OUT/gpu_check.log" >&2
    finish 3
fi

# 2. the wheel, installed once per wheel; nothing that shadows what the host has
install_wheels() {
    shopt -s nullglob
    local ours=(.whl/aieng-*.whl) others=() wheel
    for wheel in .whl/*.whl; do
        [[ "$(basename "$wheel")" == aieng-* ]] || others+=("$wheel")
    done
    if [[ ${#ours[@]} -ne 1 ]]; then
        say "run.sh $part: want exactly one .whl/aieng-*.whl, found ${#ours[@]}: build one with" \
            "'bash benches/gpu/stage.sh' (and carry .whl to the device)" >&2
        return 2
    fi
    if ((${#others[@]})) && ! "$PYTHON" - "${others[@]}" > "$PART_OUT/wheels.log" 2>&1 <<'PY'; then
import sys
from importlib.metadata import PackageNotFoundError, version
shadowing = []
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1].split("-")[0]
    try:
        shadowing.append(f"{name} (the host has {version(name)})")
    except PackageNotFoundError:
        pass
if shadowing:
    print("wheels of packages the host already has would shadow them:", ", ".join(shadowing))
    sys.exit(1)
PY
        say "run.sh $part: $(cat "$PART_OUT/wheels.log"); stage without them" >&2
        return 2
    fi
    local hash
    hash="$(cat "${ours[0]}" "${others[@]}" | sha256sum | cut -c1-16)"
    SITE="${TMPDIR:-/tmp}/aieng-site-$hash"
    if [[ ! -e "$SITE/.installed" ]]; then
        rm -rf "$SITE"
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${ours[0]}" \
            "${others[@]}" > "$PART_OUT/install.log" 2>&1; then
            cat "$PART_OUT/install.log" >&2
            return 2
        fi
        touch "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE"
    export AIENG_CACHE_DIR="$SITE/aieng-cache"  # kernels compiled on this host's NVRTC, reused
}

# 3. the machine
record_machine() {
    {
        date -u
        nvidia-smi || true
        "$PYTHON" - "$SITE" <<'PY'
import importlib.util, sys
import aieng, torch
from cuda.bindings import nvrtc
assert aieng.__file__.startswith(sys.argv[1]), f"aieng imported from {aieng.__file__}, not the wheel"
spec = importlib.util.find_spec("pytest")  # the test parts need the host's
assert spec is None or not spec.origin.startswith(sys.argv[1]), "pytest from the wheels"
print("aieng from", aieng.__file__, "; pytest from", spec and spec.origin)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
print("capability", torch.cuda.get_device_capability(), "nvrtc", nvrtc.nvrtcVersion()[1:])
PY
    } > "$PART_OUT/machine.txt" 2>&1
}

if [[ "$SMOKE" != 1 ]]; then
    SITE=""
    install_wheels || finish 2
    record_machine || { cat "$PART_OUT/machine.txt" >&2; finish 2; }
    tail -n 3 "$PART_OUT/machine.txt" | tee -a "$SUMMARY"
else
    say "run.sh $part: smoke run on the CPU (RUN_SH_SMOKE=1): nothing here is a GPU result"
fi

# 4. the part
deadline=$((started + LIMIT))
limited() {  # what is left of the part's time; SIGINT first: pytest still writes its junit xml
    limited_share 1 1 "$@"
}

limited_share() {  # NUM DEN COMMAND...: at most NUM/DEN of what is left of the part's time
    local num=$1 den=$2
    shift 2
    local left=$(((deadline - SECONDS) * num / den))
    if ((left < 10)); then
        say "run.sh $part: out of time (limit $LIMIT s) before: $*" >&2
        return 124
    fi
    timeout -s INT -k 20 "$left" "$@"
}

run_tests() {  # NAME FILES... -> fails on a failure, an error, a skip or no test at all
    local name=$1
    shift
    if [[ "$SMOKE" == 1 ]]; then  # no test can run without a GPU: the files must collect
        limited "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only "$@" \
            > "$PART_OUT/$name.log" 2>&1
        local status=$?
        say "run.sh $part: collected $(grep -c '::' "$PART_OUT/$name.log") tests, status $status"
        return $status
    fi
    limited "$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=15 "$@" \
        --junitxml="$PART_OUT/$name.xml" 2>&1 | tee "$PART_OUT/$name.log"
    local status=${PIPESTATUS[0]}
    "$PYTHON" benches/gpu/junit_summary.py "$PART_OUT/$name.xml" | tee -a "$SUMMARY"
    local summary=${PIPESTATUS[0]}
    [[ $status -eq 0 && $summary -eq 0 ]]
}

run_bench() {  # bench_X.py ARGS... -> its own status (non-zero when its kernel path was not run)
    local name
    name="$(basename "$1" .py)"
    local smoke=()
    [[ "$SMOKE" == 1 ]] && smoke=(--smoke)
    limited "$PYTHON" "$@" "${smoke[@]}" --out "$PART_OUT" > "$PART_OUT/$name.log" 2>&1
    local status=$?
    tail -n 5 "$PART_OUT/$name.log"
    for table in "$PART_OUT"/bench_gpu_*.md; do
        [[ -e "$table" ]] && ! grep -qF "$(head -n 1 "$table")" "$SUMMARY" && cat "$table" >> "$SUMMARY"
    done
    say "run.sh $part: $name status $status"
    return $status
}

sanitizer() {  # memcheck, then racecheck, over the bfloat16 attention kernels
    # memcheck: the four model shapes; racecheck (far slower): groups 1 and 4, head_dim 64 and
    # 128. Block size 16 (each decode tile spans blocks); memcheck gets at most 3/5 of the time.
    local driver=(benches/gpu/sanitize_kernels.py --kernels attention --dtypes bfloat16
        --block-sizes 16)
    if [[ "$SMOKE" == 1 ]]; then
        limited "$PYTHON" "${driver[@]}" --smoke > "$PART_OUT/sanitize.log" 2>&1
        return $?
    fi
    local tool
    tool="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    if [[ ! -x "$tool" ]]; then
        say "run.sh sanitizer: compute-sanitizer not found"
        return 1
    fi
    # every allocation its own: out-of-bounds accesses inside torch's cached blocks show
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    local args=(--error-exitcode 1 --report-api-errors no --print-limit 50)
    local status=0 check result
    for check in memcheck racecheck; do
        if [[ $check == memcheck ]]; then
            limited_share 3 5 "$tool" --tool memcheck "${args[@]}" "$PYTHON" "${driver[@]}" \
                > "$PART_OUT/$check.log" 2>&1
        else
            limited "$tool" --tool racecheck "${args[@]}" "$PYTHON" "${driver[@]}" \
                --attention-models 2 > "$PART_OUT/$check.log" 2>&1
        fi
        result=$?
        tail -n 3 "$PART_OUT/$check.log" | tee -a "$SUMMARY"
        say "run.sh sanitizer: $check status $result"
        ((result == 0)) || status=1
    done
    return $status
}

kernel_tests() {  # ARGS... -> pytest's extra arguments
    # (NVRTC's compile checks, tests/test_cuda_compile.py, run in CI on the CPU: a kernel that
    # does not compile here fails the kernel tests that load it.)
    local files=() file
    for file in tests/test_cuda_*gpu.py; do
        [[ " ${ENGINE_TESTS[*]} " == *" $file "* ]] || files+=("$file")
    done
    run_tests tests "${files[@]}" "$@"
}

extra=("${@:2}")  # handed to pytest or the bench, e.g. `e2e --formats bfloat16`, `tests -k int4`
case "$part" in
    tests) kernel_tests "${extra[@]}" ;;
    engine-tests) run_tests engine-tests "${ENGINE_TESTS[@]}" "${extra[@]}" ;;
    benches)
        run_bench benches/gpu/bench_attention.py
        attention=$?
        run_bench benches/gpu/bench_int4.py
        ((attention == 0 && $? == 0))
        ;;
    attention) run_bench benches/gpu/bench_attention.py "${extra[@]}" ;;
    int4) run_bench benches/gpu/bench_int4.py "${extra[@]}" ;;
    e2e) run_bench benches/gpu/bench_e2e.py "${extra[@]}" ;;
    sanitizer) sanitizer ;;
esac
finish $(($? == 0 ? 0 : 1))
