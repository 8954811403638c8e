"""The native CPU decoder (`aieng._core.CpuDecoder`, one Rust call per step) against transformers
and against the torch runner, on the tiny checkpoints of every family test: it is chosen by
default on the CPU, its greedy tokens are transformers' in float32 with a float32 cache (batched, in
chunks, after a prefix-cache hit), its hidden states are the torch runner's; the bfloat16 cache it
gets by default, bfloat16 and INT4/INT8 weights stay within the INT4 tests' closeness rule; the
engine's chunked prefill, prefix cache, preemption, n > 1 sampling, structured outputs and draft
model run through it on the default cache; what it does not cover (MoE, `cpu_native="off"`) runs
on the torch runner with one log line."""

import dataclasses
import logging

import numpy as np
import pytest
import test_gemma
import test_llama_families
import test_moe_and_phi3
import torch
from core_driver import CoreDriver
from hf_parity import BLOCK_SIZE, HFReference, check_batched, check_prefix_hit
from test_quantized_checkpoints import Quantized
from text_fixtures import PROMPTS
from tiny_models import ARCHITECTURES, build_checkpoint, hf_greedy, load_hf

from aieng import LLM, SamplingParams
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.errors import InvalidArgumentError
from aieng.sampling import StructuredOutputsParams
from aieng.worker.runner import ModelRunner

LENGTHS = [1, 5, 12, 17, 33]
CLOSE = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)


def build(name: str, folder):
    """A tiny checkpoint of `name`, by the builder of the family test that owns it."""
    if name in ARCHITECTURES:
        return build_checkpoint(name, folder)
    for module in (test_gemma, test_llama_families, test_moe_and_phi3):
        if name in module.CHECKPOINTS:
            return module.build(name, folder)
    raise KeyError(name)


FAMILIES = [
    *sorted(ARCHITECTURES),  # llama (llama3 RoPE), mistral (window), qwen2 (biases), qwen3
    "granite_bias",
    "olmo2",
    "smollm3_list",
    "phi3",
    "gemma2",
    "gemma3",
]


def runner(folder, **options) -> ModelRunner:
    args = EngineArgs(model=str(folder), block_size=BLOCK_SIZE, kv_cache_memory=1 << 22, **options)
    return ModelRunner(create_engine_config(args))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    # Phi-3's prompts stay within its original context (its family test says why).
    lengths = test_moe_and_phi3.PHI3_LENGTHS if request.param == "phi3" else LENGTHS
    return HFReference(folder, lengths, seed=3)


def test_native_is_chosen_and_matches_transformers(family):
    assert family.runner.native is not None
    check_batched(family, chunk_size=4)
    check_prefix_hit(family, shared_blocks=2, tail=family.prompts[1])


@torch.inference_mode()
def test_native_hidden_states_are_the_torch_runners(family):
    """A mixed step (a prefill chunk beside decodes) through both paths of one runner."""
    ours = family.runner
    torch_runner = runner(family.folder, cpu_native="off")
    assert torch_runner.native is None
    requests = [(0, 9), (9, 1), (3, 1)]  # (tokens already cached, tokens this step)
    hidden = {}
    for name, r in (("native", ours), ("torch", torch_runner)):
        caches = r.kv_spec.allocate(16, r.device, r.attention)
        # First fill each request's context, then run the mixed step itself.
        prefill = _plan([(0, done) for done, _ in requests if done])
        r._forward(prefill, _tables(len(prefill.seq_lens)), caches)
        step = _plan(requests, skip_cached=True)
        hidden[name] = r._forward(step, _tables(len(requests)), caches)
    torch.testing.assert_close(hidden["native"], hidden["torch"], atol=1e-5, rtol=1e-5)


def _tables(rows: int) -> np.ndarray:
    """Row r owns blocks 4r .. 4r + 3."""
    return np.arange(rows * 4, dtype=np.int32).reshape(rows, 4)


def _plan(requests, skip_cached=False):
    """A forward over `requests` (cached, new) with ids from a fixed generator."""
    from aieng.worker.step_plan import ForwardArrays

    ids, positions, slots, starts, computed, lens = [], [], [], [0], [], []
    generator = np.random.default_rng(0)
    tokens = generator.integers(3, 200, size=64)
    for row, (done, new) in enumerate(requests):
        span = range(done, done + new) if skip_cached else range(0, done + new)
        for p in span:
            ids.append(tokens[p + row])
            positions.append(p)
            slots.append(row * 4 * BLOCK_SIZE + p)
        starts.append(len(ids))
        computed.append(span.start)
        lens.append(done + new)
    i32 = lambda v: np.asarray(v, np.int32)  # noqa: E731
    return ForwardArrays(
        i32(ids), i32(positions), i32(slots), i32(starts), i32(computed), i32(lens)
    )


def assert_close_by_the_int4_rule(ours, theirs):
    """Up to the first difference the tokens are identical with logprobs within 0.05; at it,
    their token is in our top 2 within 0.1 of our best (the INT4 tests' rule)."""
    differences = 0
    for a, b in zip(ours, theirs, strict=True):
        for i, (mine, other) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != other:
                differences += 1
                top = a.top_logprobs[i]
                assert other in top and top[mine] - top[other] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.05
    assert differences <= 1


def _run(r: ModelRunner, prompts):
    driver = CoreDriver(r, chunk_size=4)
    for prompt in prompts:
        driver.add(prompt, CLOSE)
    return driver.run()


def _expected(pairs):
    """transformers' (tokens, logprobs) pairs as the rule reads a request."""
    return [type("Expected", (), {"output": t, "logprobs": lp}) for t, lp in pairs]


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "qwen3"])
def test_bfloat16_weights_follow_transformers(name, tmp_path):
    """bfloat16 weights (and cache) through the native decoder, against transformers in float32
    on the same weights rounded to bfloat16: the INT4 tests' closeness rule. (The native
    decoder keeps float32 activations between ops where the torch path rounds each op's output
    to bfloat16, so it is nearer this reference than the torch path is.)"""
    folder = build(name, tmp_path)
    native = runner(folder, dtype="bfloat16")
    assert native.native is not None
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in LENGTHS]
    hf = load_hf(folder).to(torch.bfloat16).to(torch.float32)
    expected = _expected(hf_greedy(hf, p, CLOSE.max_tokens) for p in prompts)
    assert_close_by_the_int4_rule(_run(native, prompts), expected)


def test_the_default_cache_is_bfloat16_and_follows_transformers(family):
    """kv_cache_dtype="auto" under the native decoder and float32 weights is a bfloat16 cache:
    half the float32 cache's bytes, so twice its blocks in the same budget; its tokens and
    logprobs stay within the INT4 tests' closeness rule of transformers in float32 (the float32
    cache is identical to them: the fixture's runner)."""
    default = runner(family.folder)
    assert default.native is not None and default.kv_spec.cache_dtype == "bfloat16"
    assert default.kv_caches[0][0].dtype == torch.bfloat16
    assert family.runner.kv_spec.cache_dtype == "float32"
    assert 2 * default.kv_spec.block_bytes == family.runner.kv_spec.block_bytes
    assert default.num_blocks == 2 * family.runner.num_blocks
    assert_close_by_the_int4_rule(_run(default, family.prompts), _expected(family.expected))


def test_the_torch_runner_keeps_the_models_dtype_and_refuses_another(tmp_path):
    """Without the native decoder "auto" is the model's dtype (the torch path reads no other);
    a float cache of another dtype is refused by name."""
    folder = build("qwen3", tmp_path)
    assert runner(folder, cpu_native="off").kv_spec.cache_dtype == "float32"
    assert runner(folder, dtype="bfloat16").kv_spec.cache_dtype == "bfloat16"
    native_float32 = runner(folder, dtype="bfloat16", kv_cache_dtype="float32")
    assert native_float32.native is not None and native_float32.kv_spec.dtype == torch.float32
    for dtype, kv_cache_dtype in (("float32", "bfloat16"), ("bfloat16", "float32")):
        with pytest.raises(ValueError, match="read by the native CPU decoder only"):
            runner(folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, cpu_native="off")


@pytest.fixture(scope="module", params=[("llama", "awq-g32"), ("qwen2", "gptq-8bit-channel-asym")])
def quantized(request, tmp_path_factory):
    arch, fmt = request.param
    return Quantized(arch, fmt, tmp_path_factory.mktemp(f"{arch}-{fmt}"))


def test_quantized_weights_follow_transformers(quantized):
    """int8x2 layers through the native decoder, against transformers on the same weights
    dequantized; W4A8 (int8, what auto picks) against the torch runner on the same kernel (its
    accuracy contract is perplexity: test_cpu_kernels.py). A float32 cache, so the difference
    measured is the weights'."""
    args = dict(block_size=4, kv_cache_memory=1 << 22, kv_cache_dtype="float32")
    accurate = EngineArgs(model=str(quantized.folder), cpu_quant_kernel="int8x2", **args)
    native = ModelRunner(create_engine_config(accurate))
    assert native.native is not None
    outputs = _run(native, quantized.prompts)
    assert_close_by_the_int4_rule(outputs, _expected(quantized.expected))
    w4a8 = EngineArgs(model=str(quantized.folder), cpu_quant_kernel="int8", **args)
    torch_w4a8 = EngineArgs(
        model=str(quantized.folder), cpu_quant_kernel="int8", cpu_native="off", **args
    )
    ours = _run(ModelRunner(create_engine_config(w4a8)), quantized.prompts)
    theirs = _run(ModelRunner(create_engine_config(torch_w4a8)), quantized.prompts)
    assert_close_by_the_int4_rule(ours, theirs)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from test_llm import make_model

    return make_model(tmp_path_factory.mktemp("engine"))


def _generate(folder, prompts, params, **options):
    llm = LLM(str(folder), block_size=4, **options)
    assert (llm.engine.runner.native is not None) == (options.get("cpu_native") != "off")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_pool_whole()
    stats = llm.engine.core.stats()
    return [[c.token_ids for c in o.outputs] for o in outputs], stats


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache_memory=1 << 22, long_prefill_token_threshold=3),  # chunked prefill
        dict(kv_cache_memory=28 * 2048),  # preemption
    ],
    ids=["chunked", "preempted"],
)
def test_the_engine_through_native_equals_the_torch_runner(llama_dir, options):
    """On a float32 cache, the torch runner's tokens; on the default bfloat16 cache, its own
    tokens without chunks or preemption."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    native, stats = _generate(llama_dir, PROMPTS, greedy, kv_cache_dtype="float32", **options)
    torch_path, _ = _generate(llama_dir, PROMPTS, greedy, cpu_native="off", **options)
    assert native == torch_path
    bfloat16, bfloat16_stats = _generate(llama_dir, PROMPTS, greedy, **options)
    whole, whole_stats = _generate(llama_dir, PROMPTS, greedy, kv_cache_memory=1 << 22)
    assert bfloat16 == whole and whole_stats["num_preemptions"] == 0
    if "long_prefill_token_threshold" not in options:
        assert stats["num_preemptions"] > 0 and bfloat16_stats["num_preemptions"] > 0


def test_prefix_hits_sampling_and_structured_outputs_through_native(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_memory=1 << 22)
    assert llm.engine.runner.native is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tok = llm.get_tokenizer()
    shared = tok.encode(PROMPTS[7])[:16]
    prompts = [shared, [*shared, 5, 6, 7]]
    first = llm.generate(prompts, greedy, use_tqdm=False)
    again = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [12, 16]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    n_params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    (sampled,) = llm.generate([PROMPTS[0]], n_params, use_tqdm=False)
    (repeat,) = llm.generate([PROMPTS[0]], n_params, use_tqdm=False)
    assert len(sampled.outputs) == 3
    assert [c.token_ids for c in sampled.outputs] == [c.token_ids for c in repeat.outputs]
    choices = ["Moses", "Aaron"]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    for out in llm.generate(PROMPTS[:3], constrained, use_tqdm=False):
        assert out.outputs[0].text in choices
    llm.engine.check_pool_whole()


def test_moe_and_the_torch_attention_run_on_torch_with_one_line(tmp_path, caplog):
    moe = test_moe_and_phi3.build("qwen3_moe", tmp_path / "moe")
    with caplog.at_level(logging.INFO, logger="aieng.worker.cpu_native"):
        assert runner(moe).native is None
        llama = build("llama", tmp_path / "llama")
        assert runner(llama, attention_backend="torch").native is None
    lines = [r.getMessage() for r in caplog.records if "native decoder" in r.getMessage()]
    assert len(lines) == 2
    assert "MoE" in lines[0] and "attention backend is 'torch'" in lines[1]


@pytest.mark.parametrize(
    ("name", "dtype"), [("qwen2", "float32"), ("qwen2", "bfloat16"), ("gemma2", "float32")]
)
def test_the_int8_cache_through_native_follows_the_torch_runner(tmp_path, name, dtype):
    """The INT8 KV cache (scales in the model's dtype) written and read by the native decoder:
    the closeness rule against the torch runner on the same cache (float32), and against
    transformers on the bfloat16-rounded weights (bfloat16: the torch path rounds every op's
    output, see the bfloat16 test)."""
    folder = build(name, tmp_path)
    options = dict(kv_cache_dtype="int8", dtype=dtype)
    native = runner(folder, **options)
    assert native.native is not None and native.kv_spec.quantized
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in LENGTHS]
    if dtype == "float32":
        reference = _run(runner(folder, cpu_native="off", **options), prompts)
    else:
        hf = load_hf(folder).to(torch.bfloat16).to(torch.float32)
        reference = _expected(hf_greedy(hf, p, CLOSE.max_tokens) for p in prompts)
    assert_close_by_the_int4_rule(_run(native, prompts), reference)


def test_a_bad_step_is_a_typed_error(tmp_path):
    r = runner(build("llama", tmp_path))
    caches = r.kv_spec.allocate(4, r.device, r.attention)
    plan = _plan([(0, 3)])
    bad = dataclasses.replace(plan, input_ids=np.asarray([0, 1, 10_000], np.int32))
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        r._forward(bad, _tables(1), caches)


def test_a_draft_model_runs_native_and_the_target_as_its_own_draft_is_always_accepted(llama_dir):
    spec = {"model": str(llama_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    llm = LLM(str(llama_dir), block_size=4, kv_cache_memory=1 << 22, speculative_config=spec)
    target, draft = llm.engine.runner, llm.engine.runner.draft
    assert target.native is not None and draft.native is not None
    # Each resolves `auto` the same way: both caches bfloat16, the budget counting both.
    assert target.kv_spec.cache_dtype == draft.kv_spec.cache_dtype == "bfloat16"
    assert target.block_bytes == target.kv_spec.block_bytes + draft.kv_spec.block_bytes
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:4], greedy, use_tqdm=False)
    plain, _ = _generate(llama_dir, PROMPTS[:4], greedy, kv_cache_memory=1 << 22)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == plain
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    llm.engine.check_pool_whole()


def test_torch_runs_single_threaded_while_the_native_step_runs(llama_dir, monkeypatch):
    """torch's OpenMP threads would spin on the pool's cores after every torch op of the step
    (sampling): within a native step torch has one thread, the decoder gets the user's count,
    and the user's count is back once the step ends (kernels/threads.py)."""
    from aieng.worker import cpu_native

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(llama_dir), block_size=4, kv_cache_memory=1 << 22)
        seen: list[tuple[int, int]] = []
        forward = cpu_native.NativeDecoder.forward

        def spy(self, *args, **kwargs):
            seen.append((torch.get_num_threads(), cpu_native.kernel_threads()))
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(cpu_native.NativeDecoder, "forward", spy)
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
        assert seen and set(seen) == {(1, 2)}, seen
        assert torch.get_num_threads() == 2  # the user's count, between and after steps
    finally:
        torch.set_num_threads(before)


def test_the_thread_scope_nests_and_restores_on_error():
    from aieng.kernels.threads import kernel_threads, pool_owns_the_cores

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pool_owns_the_cores() as outer:
            assert (outer, torch.get_num_threads(), kernel_threads()) == (2, 1, 2)
            with pool_owns_the_cores() as inner:  # a draft model's step inside the target's
                assert (inner, torch.get_num_threads()) == (2, 1)
            assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), pool_owns_the_cores():
            raise RuntimeError("the step failed")
        assert (torch.get_num_threads(), kernel_threads()) == (2, 2)
    finally:
        torch.set_num_threads(before)
