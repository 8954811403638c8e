"""CUDA graphs for decode steps on an NVIDIA GPU (issue 12): the runner captures every size,
replays padded decode steps, and gives the tokens of eager steps (`enforce_eager=True`) —
identical greedy tokens in float32 over the torch reference backend, dense and INT4; with the
cuda attention kernels in bfloat16 the first-divergence rule (their split-K plan is fixed at
capture, so sums may associate differently). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, build_checkpoint

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: CUDA graphs exist only there (CPU checks of the sizes, padding "
    "and graph metadata: tests/test_cuda_int4.py)",
)

MAX_NUM_SEQS = 20  # captured sizes 1, 2, 4, 8, 16, 20
PROMPT_LENS = [1, 9, 30, 4, 17, 60, 2, 11, 5, 23, 40, 3, 8]  # 13 requests: padded rows
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    dense = build_checkpoint("llama", root / "dense", hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    rtn = QuantizeOptions(method="rtn", scheme=QuantScheme(4, 32, symmetric=False))
    quantize_checkpoint(dense, root / "int4", rtn, progress=None)  # aieng's own writer
    return {"dense": dense, "int4": root / "int4"}


def generate(folder, enforce_eager: bool, **options) -> tuple[list, int]:
    args = EngineArgs(
        model=str(folder), device="cuda", block_size=16, kv_cache_memory=1 << 24,
        max_num_seqs=MAX_NUM_SEQS, enforce_eager=enforce_eager, **options,
    )  # fmt: skip
    runner = ModelRunner(create_engine_config(args))
    replays = 0
    if not enforce_eager:
        assert runner.graphs is not None, "graphs were not captured (see the log)"
        assert runner.graphs.sizes == [1, 2, 4, 8, 16, 20]
        run = runner.graphs.run

        def counted(*a):
            nonlocal replays
            replays += 1
            return run(*a)

        runner.graphs.run = counted
    else:
        assert runner.graphs is None
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(7)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    return scheduler.run(), replays


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_graphs_give_eager_tokens_float32(checkpoints, kind) -> None:
    options = dict(dtype="float32", attention_backend="torch")
    eager, _ = generate(checkpoints[kind], True, **options)
    graphs, replays = generate(checkpoints[kind], False, **options)
    assert replays >= MAX_TOKENS - 1  # every decode step replayed a graph
    for a, b in zip(graphs, eager, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graphs_follow_eager_bfloat16_kernels(checkpoints, kind, kv_cache_dtype) -> None:
    options = dict(dtype="bfloat16", attention_backend="auto", kv_cache_dtype=kv_cache_dtype)
    eager, _ = generate(checkpoints[kind], True, **options)
    graphs, replays = generate(checkpoints[kind], False, **options)
    assert replays >= MAX_TOKENS - 1
    for a, b in zip(graphs, eager, strict=True):
        for i, (mine, theirs) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != theirs:
                top = a.top_logprobs[i]
                assert theirs in top and top[mine] - top[theirs] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.1
