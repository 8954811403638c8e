"""The `cuda` attention backend's host side, on the CPU: the per-step metadata the kernels read,
the random steps of its self-check, the self-check catching a wrong backend, and the selector
falling back to the torch reference (with a warning naming the kernel) when the kernels cannot
be compiled — without a GPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import aieng.attention.cuda_paged as cuda_paged
import aieng.attention.cuda_self_check as cuda_self_check
from aieng.attention import AttentionInputs
from aieng.attention.cuda_paged import build_cuda_metadata, split_plan
from aieng.attention.cuda_self_check import (
    CHECK_BLOCK_SIZES,
    GRAPH_PLAN_LEN,
    PREFILLS,
    REPEATS,
    SPLIT_DECODES,
    RequestSpec,
    check_block_sizes,
    check_cases,
    checked_cuda_backend,
    cuda_unsupported_reason,
    random_step,
    self_check,
)
from aieng.attention.selector import select_attention_backend
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.model_config import ModelConfig
from aieng.kernels import KernelCompileError
from aieng.kernels.paged_attention import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    PREFILL_BLOCK_M,
    SplitPlan,
)


def llama(**extra: object) -> ModelConfig:
    fields = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 512,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
    }
    return ModelConfig.from_dicts({**fields, **extra})


STEP = [RequestSpec(0, 37), RequestSpec(20, 1), RequestSpec(50, 70), RequestSpec(0, 1)]


def test_random_step_maps_every_new_token_to_its_block() -> None:
    inputs, num_blocks = random_step(STEP, 16, torch.device("cpu"), seed=3)
    tables, slots = inputs.block_tables, inputs.slot_mapping.numpy()
    assert inputs.query_start_loc.tolist() == [0, 37, 38, 108, 109]
    assert inputs.seq_lens.tolist() == [37, 21, 120, 1]
    used = [
        b for r, spec in enumerate(STEP) for b in tables[r, : -(-(spec.computed + spec.new) // 16)]
    ]
    assert sorted(used) == list(range(1, num_blocks))  # disjoint, block 0 only as padding
    for r, spec in enumerate(STEP):
        start = inputs.query_start_loc[r]
        for i in range(spec.new):
            position = spec.computed + i
            assert slots[start + i] == tables[r, position // 16] * 16 + position % 16


def test_metadata_splits_decodes_from_prefills() -> None:
    inputs, _ = random_step(STEP, 16, torch.device("cpu"))
    meta = build_cuda_metadata(inputs)
    assert meta.num_tokens == 109
    assert meta.decode is not None and meta.prefill is not None
    assert meta.decode.rows.tolist() == [37, 108]  # the decode requests' token rows
    assert meta.decode.seq_lens.tolist() == [21, 1]
    assert meta.decode.block_tables.tolist() == inputs.block_tables[[1, 3]].tolist()
    assert meta.prefill.tile_request.tolist() == [0, 2, 2]
    assert meta.prefill.tile_first.tolist() == [0, 0, PREFILL_BLOCK_M]
    assert meta.prefill.query_start.tolist() == inputs.query_start_loc.tolist()
    for tensor in (meta.decode.rows, meta.prefill.block_tables, meta.prefill.num_computed):
        assert tensor.dtype == torch.int32
    only_decodes, _ = random_step([RequestSpec(5, 1)], 16, torch.device("cpu"))
    assert build_cuda_metadata(only_decodes).prefill is None


def test_split_plan_of_a_decode_batch_reads_the_window() -> None:
    inputs, _ = random_step([RequestSpec(4000, 1), RequestSpec(10, 1)], 16, torch.device("cpu"))
    decode = build_cuda_metadata(inputs).decode
    assert decode is not None
    whole = split_plan(decode, None, 32, 8, 128, num_sms=132, ctas_per_sm=4)
    assert whole.num_splits > 1 and whole.num_splits * whole.split_tokens >= 4001
    assert 2 * 8 * whole.num_splits <= 132 * 4  # one wave of the kernel's CTA slots
    assert split_plan(decode, 200, 32, 8, 128, num_sms=132, ctas_per_sm=4) == SplitPlan(1, 200)


class Perturbed(TorchPagedAttention):
    """A backend that is wrong by 1% of its output: what the self-check must refuse."""

    name = "perturbed"

    def forward(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        out = super().forward(*args, **kwargs)
        return out * 1.01


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 40])
def test_self_check_passes_the_reference_and_refuses_a_wrong_backend(
    int8: bool, window: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = torch.device("cpu")
    args = (8, 2, 64, torch.float32, int8, (window,), cpu)
    blocks = {"block_sizes": (16,)}  # the torch stand-in reads any block size alike
    assert self_check(TorchPagedAttention((window,)), *args, **blocks)
    with caplog.at_level(logging.WARNING):
        assert not self_check(Perturbed((window,)), *args, **blocks)
    assert "perturbed decode differs from its reference" in caplog.text


class Stale(TorchPagedAttention):
    """A backend that returns its first output again for every later step of the same shape:
    a kernel that leaves its output unwritten over memory still holding a correct result."""

    name = "stale"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.first: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        out = super().forward(*args, **kwargs)
        return self.first.setdefault(tuple(out.shape), out)


class ContiguousQOnly(TorchPagedAttention):
    """A backend that reads q as if it were contiguous, ignoring its row stride: wrong for the
    view of a fused QKV projection the model passes."""

    name = "contiguous-q"

    def forward(self, layer, q, k, v, kv_cache, metadata) -> torch.Tensor:  # type: ignore[no-untyped-def]
        flat = torch.as_strided(q, q.shape, (q.shape[1] * q.shape[2], q.shape[2], 1))
        return super().forward(layer, flat, k, v, kv_cache, metadata)


def test_each_case_runs_twice_on_fresh_inputs_with_q_a_fused_view(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second run of every case has new inputs (a stale output fails it), and q, k, v are
    views of one fused QKV projection (a kernel ignoring q's row stride fails)."""
    cpu = torch.device("cpu")
    args = (8, 2, 64, torch.float32, False, (None,), cpu)
    blocks = {"block_sizes": (16,)}
    assert REPEATS >= 2
    assert self_check(TorchPagedAttention((None,)), *args, **blocks)
    with caplog.at_level(logging.WARNING):
        assert not self_check(Stale((None,)), *args, **blocks)
        assert not self_check(ContiguousQOnly((None,)), *args, **blocks)
    assert "stale decode differs" in caplog.text and "contiguous-q decode differs" in caplog.text


def test_the_checks_cover_the_engines_block_size_and_graph_plans() -> None:
    assert check_block_sizes(None) == CHECK_BLOCK_SIZES == (16, 32, 128)
    assert check_block_sizes(64) == (16, 32, 64, 128) and check_block_sizes(16) == (16, 32, 128)
    planned = [case.planned_len for case in check_cases(None)["decode"] if case.planned_len]
    assert planned and set(planned) == {GRAPH_PLAN_LEN}
    assert not any(case.planned_len for case in check_cases(100)["prefill"])
    # planned for GRAPH_PLAN_LEN positions, one short decode gets the most splits there are
    inputs, _ = random_step([RequestSpec(299, 1)], 16, torch.device("cpu"))
    decode = build_cuda_metadata(inputs).decode
    assert decode is not None
    decode.planned_len = GRAPH_PLAN_LEN
    plan = split_plan(decode, None, 8, 1, 64, num_sms=132, ctas_per_sm=6)
    assert plan.num_splits == MAX_SPLITS and plan.split_tokens == MIN_SPLIT_TOKENS


def test_the_selector_checks_the_engines_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block size the engine runs with reaches the cuda backend's check (which adds it to
    CHECK_BLOCK_SIZES, above)."""
    asked: list[int | None] = []

    def checked(config, device, dtype, kv_cache_dtype, block_size=None):  # type: ignore[no-untyped-def]
        asked.append(block_size)
        return None  # as if a kernel failed: the reference serves

    monkeypatch.setattr(cuda_self_check, "checked_cuda_backend", checked)
    gpu = torch.device("cuda", 0)
    backend = select_attention_backend("auto", llama(), gpu, torch.float16, "auto", 64)
    assert isinstance(backend, TorchPagedAttention) and asked == [64]


def test_self_check_cases_cover_split_and_prefill_paths() -> None:
    longest = max(s.computed + s.new for s in SPLIT_DECODES)
    assert longest >= 2 * 256  # long enough that a small batch is split
    assert any(s.computed == 0 and s.new > 1 for s in PREFILLS)  # fresh prefill
    assert any(s.computed > 0 and s.new > 1 for s in PREFILLS)  # chunk after a cached prefix
    assert any(s.new > PREFILL_BLOCK_M for s in PREFILLS)  # several query tiles


def test_unsupported_models_and_devices_are_named() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cuda_unsupported_reason(llama(), gpu, torch.float16) is None
    assert "NVIDIA" in (cuda_unsupported_reason(llama(), cpu, torch.float16) or "")
    assert "float16" in (cuda_unsupported_reason(llama(), gpu, torch.float32) or "")
    assert "head_dim" in (cuda_unsupported_reason(llama(head_dim=256), gpu, torch.bfloat16) or "")


def test_auto_on_the_cpu_is_not_cuda_and_cuda_is_refused() -> None:
    from aieng.attention.cpu_paged import CpuPagedAttention

    cpu = torch.device("cpu")
    assert isinstance(
        select_attention_backend("auto", llama(), cpu, torch.float32), CpuPagedAttention
    )
    assert isinstance(
        select_attention_backend("auto", llama(), cpu, torch.bfloat16), CpuPagedAttention
    )
    assert isinstance(
        select_attention_backend("auto", llama(), cpu, torch.float16), TorchPagedAttention
    )
    with pytest.raises(ValueError, match=r"'cuda' cannot serve this model: .*NVIDIA"):
        select_attention_backend("cuda", llama(), cpu, torch.float32)


def test_a_kernel_that_fails_to_compile_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing_compile(name: str, *args: object, **kwargs: object) -> None:
        raise KernelCompileError(f"{name}.cu", 90, f"{name}.cu(1): error: injected failure")

    monkeypatch.setattr(cuda_paged, "load_module", failing_compile)
    gpu = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING):
        assert checked_cuda_backend(llama(), gpu, torch.float16, "auto") is None
    assert "paged_attention_decode.cu" in caplog.text and "injected failure" in caplog.text
    caplog.clear()
    for name in ("auto", "cuda"):
        with caplog.at_level(logging.WARNING):
            backend = select_attention_backend(name, llama(), gpu, torch.float16, "int8")
        assert isinstance(backend, TorchPagedAttention)
        assert "torch reference" in caplog.text


def test_metadata_of_an_empty_width_table_is_fine() -> None:
    inputs = AttentionInputs(
        slot_mapping=torch.tensor([3]),
        query_start_loc=np.array([0, 1]),
        num_computed_tokens=np.array([0]),
        seq_lens=np.array([1]),
        block_tables=np.array([[0]], np.int32),
        block_size=16,
    )
    meta = build_cuda_metadata(inputs)
    assert meta.decode is not None and meta.decode.rows.tolist() == [0]
