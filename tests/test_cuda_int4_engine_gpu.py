"""The CUDA INT4 kernels in the engine on an NVIDIA GPU (issue 12): a tiny Llama checkpoint
quantized by aieng's own writer, greedy decoding with the kernels on against the dequantize
reference, float32 (identical tokens) and bfloat16 (vLLM's first-divergence rule). An engine
test: it builds a checkpoint with the host's transformers, so benches/gpu/run.sh runs it in the
`engine-tests` part, after the kernel tests (tests/test_cuda_int4_gpu.py). Skipped without a
GPU."""

from __future__ import annotations

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, build_checkpoint

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.quantization import methods
from aieng.quantization.linear_method import QuantizedLinearMethod
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the CUDA INT4 kernels run only there (CPU checks: "
    "tests/test_cuda_int4.py)",
)

PROMPT_LENS = [1, 7, 40, 23]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-gpu")
    source = build_checkpoint("llama", root / "float", hidden_size=256, intermediate_size=512)
    rtn = QuantizeOptions(method="rtn", scheme=QuantScheme(4, 32, symmetric=False))
    quantize_checkpoint(source, root / "int4", rtn, progress=None)  # aieng's own writer
    return root / "int4"


def run_engine(folder, dtype: str, kernels: bool, monkeypatch) -> list:
    with monkeypatch.context() as patch:
        if not kernels:  # the torch reference: dequantize then matmul
            patch.setattr(methods, "CudaInt4LinearMethod", QuantizedLinearMethod)
        args = EngineArgs(
            model=str(folder), device="cuda", dtype=dtype, block_size=16, kv_cache_memory=1 << 24
        )
        runner = ModelRunner(create_engine_config(args))
    kinds = methods.describe_linear_kernels(runner.model)
    assert ("cuda_int4" in kinds) == kernels, kinds
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(3)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    return scheduler.run()


def test_engine_float32_kernels_give_the_reference_tokens(int4_checkpoint, monkeypatch) -> None:
    ours = run_engine(int4_checkpoint, "float32", True, monkeypatch)
    reference = run_engine(int4_checkpoint, "float32", False, monkeypatch)
    for a, b in zip(ours, reference, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-3, rtol=0
        )


def test_engine_bfloat16_kernels_follow_the_reference(int4_checkpoint, monkeypatch) -> None:
    """vLLM's first-divergence rule: identical tokens with close logprobs up to the first
    difference; there the reference's token is in our top 2, nearly tied with ours."""
    ours = run_engine(int4_checkpoint, "bfloat16", True, monkeypatch)
    reference = run_engine(int4_checkpoint, "bfloat16", False, monkeypatch)
    for a, b in zip(ours, reference, strict=True):
        for i, (mine, theirs) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != theirs:
                top = a.top_logprobs[i]
                assert theirs in top and top[mine] - top[theirs] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.1
