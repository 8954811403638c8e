"""The GPU device run cannot rot on the CPU: every GPU bench and the sanitizer driver run their
`--smoke` mode here (tiny shapes, the torch backend or the kernels' host emulations, the same
calls and output checks as on the device), the checks that stop a bench whose kernel path is not
the one it claims fail when they should, the junit reader fails a run with a skip, and
benches/gpu/run.sh parses its parts and refuses to run without a GPU."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
import torch

from aieng.kernels.check_child import DEFAULT_CHILD_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
GPU_BENCHES = ROOT / "benches" / "gpu"
RUN_SH = GPU_BENCHES / "run.sh"


MODULES = ("bench_attention", "bench_e2e", "bench_int4", "common", "junit_summary")


@pytest.fixture(scope="module")
def benches() -> dict[str, ModuleType]:
    """The benches/gpu modules, imported as run.sh runs them (their folder on sys.path)."""
    sys.path.insert(0, str(GPU_BENCHES))
    try:
        return {name: importlib.import_module(name) for name in (*MODULES, "sanitize_kernels")}
    finally:
        sys.path.remove(str(GPU_BENCHES))


def smoke_result(tmp_path: Path, module, name: str) -> dict:
    assert module.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["smoke"] is True
    assert (tmp_path / f"{name}.md").read_text().startswith(("#", "INT4", "aieng"))
    recorded = ROOT / "benches" / "results" / f"{name}.json"  # a smoke run never records
    assert not recorded.exists() or not json.loads(recorded.read_text()).get("smoke")
    return result


def test_attention_smoke_checks_every_row(benches, tmp_path) -> None:
    result = smoke_result(tmp_path, benches["bench_attention"], "bench_gpu_attention")
    setup = benches["bench_attention"].SMOKE
    assert len(result["rows"]) == 4 * len(setup.shapes)  # 2 dtypes x 2 caches
    for row in result["rows"]:
        assert row["backend"] == "torch" and row["splits"] >= 1
        assert 0 <= row["worst_row_error"] <= 2.5e-2
        assert row["kernel_ms"] > 0 and row["bytes_read"] > 0


def test_int4_smoke_checks_both_paths(benches, tmp_path) -> None:
    result = smoke_result(tmp_path, benches["bench_int4"], "bench_gpu_int4")
    setup = benches["bench_int4"].SMOKE
    assert [(s["N"], s["K"]) for s in result["shapes"]] == list(setup.shapes)
    for shape in result["shapes"]:
        assert [row["M"] for row in shape["latency"]] == list(setup.m_values)
        assert {row["path"] for row in shape["latency"]} == {"gemv", "gemm"}
        for row in shape["latency"]:
            assert row["gemv_error"] < 1e-2 and row["gemm_error"] < 1e-2


def test_e2e_smoke_checks_the_engines_report(benches, tmp_path) -> None:
    result = smoke_result(tmp_path, benches["bench_e2e"], "bench_gpu_e2e")
    rows = {(row["format"], row["path"], row["requests"]): row for row in result["runs"]}
    assert set(rows) == {
        ("bfloat16", "kernels", 6),
        ("int4", "kernels", 6),
        ("bfloat16", "kernels", 3),
        ("bfloat16", "reference", 3),
    }
    assert rows["bfloat16", "reference", 3]["attention"] == "torch"
    layers = benches["bench_e2e"].TINY["num_hidden_layers"]
    int4 = benches["bench_e2e"].linear_counts(rows["int4", "kernels", 6]["linear"])
    assert sum(n for kernel, n in int4.items() if kernel != "dense") == 4 * layers
    _, lens = benches["bench_e2e"].workload(6, 4, 12, 4096)
    assert rows["int4", "kernels", 6]["output_tokens"] == sum(lens)


def test_sanitizer_driver_smoke(benches) -> None:
    assert benches["sanitize_kernels"].main(["--smoke"]) == 0
    with pytest.raises(SystemExit):  # a misspelt kernel family is an error, not a no-op
        benches["sanitize_kernels"].main(["--smoke", "--kernels", "attn"])


def test_row_check_catches_one_wrong_element(benches) -> None:
    """A single faulty element of a (token, head, dim) output fails the row check and is named,
    where the global relative norm stays far inside the tolerance."""
    common = benches["common"]
    want = torch.randn(64, 8, 128, generator=torch.Generator().manual_seed(0))
    assert common.check_rows(want.clone(), want, 2.5e-2, "clean") == 0.0
    got = want.clone()
    got[37, 5, 90] += 3.0
    assert float((got - want).norm() / want.norm()) < 2.5e-2
    with pytest.raises(common.WrongOutput, match=r"row \(37, 5\)"):
        common.check_rows(got, want, 2.5e-2, "one fault")
    got[37, 5, 90] = float("nan")
    with pytest.raises(common.WrongOutput, match="inf"):
        common.check_rows(got, want, 2.5e-2, "nan")
    with pytest.raises(common.WrongOutput, match="shape"):
        common.check_rows(want[:, :4], want, 2.5e-2, "a dimension short")


def test_e2e_path_checks_refuse_a_fallback(benches) -> None:
    e2e = benches["bench_e2e"]
    good = {"attention_backend": "cuda", "linear_kernels": "112 cuda_int4", "cpu_isa": ""}
    e2e.check_paths(good, True, e2e.KERNELS_ON_GPU, "int4", 28)
    e2e.check_paths({**good, "linear_kernels": "112 dense"}, True, e2e.KERNELS_ON_GPU, "bf16", 28)
    wrong = [
        ({**good, "attention_backend": "torch"}, True, "int4", "attention backend 'torch'"),
        ({**good, "linear_kernels": "111 cuda_int4, 1 dequant"}, True, "int4", "one kernel"),
        ({**good, "linear_kernels": "100 cuda_int4"}, True, "int4", "all 112"),
        ({**good, "linear_kernels": "112 int4pack"}, True, "int4", "not 'cuda_int4'"),
        (good, False, "int4", "CUDA graphs off"),
        (good, True, "bfloat16", "quantized layers"),
    ]
    for kernels, graphs, fmt, message in wrong:
        with pytest.raises(e2e.PathMismatch, match=message):
            e2e.check_paths(kernels, graphs, e2e.KERNELS_ON_GPU, fmt, 28)
    assert e2e.linear_counts("42 int8x2 (avx512vnni), 2 dense") == {
        "int8x2 (avx512vnni)": 42,
        "dense": 2,
    }


def test_junit_summary_fails_a_run_with_a_skip(benches, tmp_path) -> None:
    """A real pytest report: a skip (what every GPU test does without a GPU) fails the run."""
    summary = benches["junit_summary"]
    (tmp_path / "test_two.py").write_text(
        "import pytest\n\ndef test_runs():\n    assert True\n\n"
        "@pytest.mark.skip(reason='needs an NVIDIA GPU')\ndef test_skips():\n    pass\n"
    )
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_two.py",
         f"--junitxml={report}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = summary.summarize(report)
    assert result.tests == 2 and not result.failed and len(result.skipped) == 1
    assert "needs an NVIDIA GPU" in result.skipped[0]
    assert summary.main([str(report)]) == 1
    assert summary.main([str(tmp_path / "missing.xml")]) == 1
    tree = ET.parse(report)  # the same report without its skip is clean
    for case in tree.getroot().iter("testcase"):
        for skipped in case.findall("skipped"):
            case.remove(skipped)
    tree.write(tmp_path / "clean.xml")
    assert summary.main([str(tmp_path / "clean.xml")]) == 0


def test_benches_refuse_to_run_without_a_gpu(benches, capsys) -> None:
    if torch.cuda.is_available():  # the same refusal through run.sh is checked below
        return
    for name in ("bench_attention", "bench_int4", "bench_e2e", "sanitize_kernels"):
        assert benches[name].main([]) == 2
        assert "no GPU visible" in capsys.readouterr().err


def run_sh(*args: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    """run.sh as on a host where torch sees no GPU (CUDA_VISIBLE_DEVICES empty)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(out),
           **env}  # fmt: skip
    return subprocess.run(
        ["bash", str(RUN_SH), *args], env=env, capture_output=True, text=True, timeout=600
    )


def part_limits() -> dict[str, int]:
    """run.sh's listing -> each part's time limit in seconds."""
    listing = run_sh(out=Path(os.devnull)).stdout.splitlines()
    parts = [line.split() for line in listing if line.startswith("  ")]
    return {words[0]: int(words[1]) for words in parts if words[2] == "s"}


def returned_files(out: Path) -> list[Path]:
    """What a device command's $OUT gives back (../shared/GPU.md): files at most two folders
    deep; asserts there is nothing deeper."""
    files = [path for path in out.rglob("*") if path.is_file()]
    assert all(len(path.relative_to(out).parts) <= 3 for path in files), files
    return files


def test_run_sh_lists_its_parts_and_refuses_without_a_gpu(tmp_path) -> None:
    for script in (RUN_SH, GPU_BENCHES / "stage.sh"):
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        if shutil.which("shellcheck"):
            check = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
            assert check.returncode == 0, check.stdout

    # the aieng wheel alone travels: a second pytest would shadow the host's and its plugins
    code = [line for line in (GPU_BENCHES / "stage.sh").read_text().splitlines()
            if not line.lstrip().startswith("#")]  # fmt: skip
    stage = "\n".join(code)
    assert "maturin" in stage and "pip download" not in stage and "pytest" not in stage

    listing = run_sh(out=tmp_path)
    assert listing.returncode == 2
    for part in ("tests", "benches", "sanitizer", "engine-tests", "e2e", "attention", "int4"):
        assert f"  {part} " in listing.stdout
    unknown = run_sh("everything", out=tmp_path)
    assert unknown.returncode == 2 and "unknown part 'everything'" in unknown.stderr

    refused = run_sh("tests", out=tmp_path)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "no GPU visible" in refused.stderr
    assert "wall" in refused.stdout
    assert sorted(p.name for p in returned_files(tmp_path)) == ["tests.log", "tests.tar.gz"]
    with tarfile.open(tmp_path / "tests.tar.gz") as archive:
        status = archive.extractfile("tests/status")
        assert status is not None and status.read().split()[0] == b"3"


def test_a_lease_fits_its_limits() -> None:
    """The first lease (15 minutes of device time, start-up included) runs tests, benches and
    sanitizer; each part ends before the run tool's 10-minute limit per command, and a start-up
    check's child process gives up on a hung kernel well inside every part."""
    limits = part_limits()
    assert limits["tests"] <= 240 and limits["benches"] <= 240 and limits["sanitizer"] <= 180
    assert limits["tests"] + limits["benches"] + limits["sanitizer"] <= 11 * 60
    assert max(limits.values()) < 600
    script = RUN_SH.read_text()
    child = re.search(r'AIENG_CHECK_TIMEOUT_S="\$\{AIENG_CHECK_TIMEOUT_S:-(\d+)\}"', script)
    assert child is not None
    assert 2 * int(child.group(1)) <= min(limits.values())
    assert DEFAULT_CHILD_TIMEOUT_S < min(limits.values())


def test_the_kernel_tests_build_no_engine_and_never_skip_on_a_gpu() -> None:
    """The `tests` part runs every tests/test_cuda_*gpu.py but the ENGINE_TESTS: none of those
    may build a checkpoint (the host's transformers) or an engine, nor skip anything on a GPU
    (junit_summary fails the part on a skip): their one skip marker is the module's "no GPU"
    guard."""
    script = RUN_SH.read_text()
    engine_list = script.split("ENGINE_TESTS=(")[1].split(")")[0]
    engine = set(re.findall(r"tests/test_cuda_\w+_gpu\.py", engine_list))
    assert engine and all((ROOT / name).is_file() for name in engine)
    kernel = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_cuda_*gpu.py")} - engine
    assert {"tests/test_cuda_attention_gpu.py", "tests/test_cuda_int4_gpu.py"} <= kernel
    for name in kernel:
        source = (ROOT / name).read_text()
        for marker in ("build_checkpoint", "ModelRunner", "tiny_models", "pytest.skip(",
                       "importorskip", "LLM(", "pytest.xfail", "mark.xfail"):  # fmt: skip
            assert marker not in source, f"{name} uses {marker}"
        guards = re.findall(r"pytest\.mark\.skip\w*\(", source)
        assert len(guards) == 1, (name, guards)
        guard = source.split("pytestmark = pytest.mark.skipif(")[1].split("reason=")[0]
        assert "torch.cuda.is_available()" in guard, name


@pytest.mark.parametrize("part", ["benches", "sanitizer", "tests"])
def test_run_sh_smoke_returns_two_files_per_part(tmp_path, part) -> None:
    """Each part on the CPU (RUN_SH_SMOKE=1: the benches' --smoke, the sanitizer driver without
    compute-sanitizer, the test parts collected only) leaves its archive and its summary in $OUT
    and nothing else, so that the first lease's three parts return 6 of the 8 files allowed."""
    env = {"RUN_SH_SMOKE": "1", "PYTHONPATH": str(ROOT / "python")}
    done = run_sh(part, out=tmp_path, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in returned_files(tmp_path)) == [f"{part}.log", f"{part}.tar.gz"]
    summary = (tmp_path / f"{part}.log").read_text()
    assert f"run.sh {part}: status 0" in summary
    with tarfile.open(tmp_path / f"{part}.tar.gz") as archive:
        names = archive.getnames()
    assert f"{part}/status" in names
    if part == "benches":
        assert {"benches/bench_gpu_attention.json", "benches/bench_gpu_int4.json"} <= set(names)
        assert "Paged decode attention" in summary and "INT4" in summary
    if part == "tests":
        assert int(re.search(r"collected (\d+) tests", summary).group(1)) > 100
