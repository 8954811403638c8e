"""The INT8 KV cache (`kv_cache_dtype="int8"`): the quantizer's error bound, paged attention over
an INT8 cache against a float reference, the engine on the four architectures (greedy tokens,
perplexity through the cache), block accounting after preemptions, prefix-cache hits, the budget,
the startup log line and `/metrics`."""

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from server_fixtures import ThreadServer, make_model_dir
from text_fixtures import PROMPTS, byte_level_bpe, save_model_dir
from tiny_models import ARCHITECTURES, build_checkpoint

import aieng.worker.runner
from aieng import LLM, SamplingParams
from aieng.attention import AttentionInputs, QuantizedKVCache
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.benchmarks.evaluate import perplexity
from aieng.cli import build_parser
from aieng.config.default_model import default_model_path
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.config.model_config import ModelConfig
from aieng.kernels.reference import (
    dequantize_int8,
    quantize_int8,
    write_kv_cache,
    write_quantized_kv_cache,
)
from aieng.worker.kv_cache import KVCacheSpec

VOCAB = 384
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
    "the face of the waters. And God said, Let there be light: and there was light."
)
ENGINE = dict(kv_cache_memory=1 << 22, block_size=4)


def make_model(folder, arch):
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return build_checkpoint(arch, folder, vocab_size=VOCAB)


# ---------------------------------------------------------------------------- the quantizer


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_round_trip_is_within_half_a_step(scale_dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=generator)
    x *= torch.logspace(-3, 3, 64)[:, None, None]  # tokens of very different magnitudes
    x[3] = 0.0  # an all-zero token
    x[5, 1, 7] = 40.0  # an outlier sets its head's scale alone
    q, scale = quantize_int8(x, scale_dtype)
    assert q.dtype == torch.int8 and scale.dtype == scale_dtype
    assert q.shape == x.shape and scale.shape == (64, 4, 1)
    assert int(q.abs().max()) <= 127
    back = dequantize_int8(q, scale, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros_like(back[3]))
    step = scale.float()
    # Half a step, plus what clamping costs when the stored scale rounded down (< 1/4 step).
    assert ((back - x).abs() <= 0.75 * step).all()
    amax = x.abs().amax(-1, keepdim=True)
    assert (step <= amax / 127 * (1 + 2**-7) + torch.finfo(scale_dtype).tiny).all()
    if scale_dtype == torch.float32:
        # Exactly representable scale: the error is at most half a step, the largest value
        # of each vector maps to +-127, and the relative error of each vector is <= 1/254.
        assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
        nonzero = amax[..., 0] > 0
        assert (q.abs().amax(-1)[nonzero] == 127).all()
        relative = (back - x).abs().amax(-1) / amax[..., 0].clamp_min(1e-30)
        assert float(relative.max()) <= 1 / 254 + 1e-6


def test_quantize_takes_half_precision_inputs():
    x = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    q, scale = quantize_int8(x, torch.bfloat16)
    back = dequantize_int8(q, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert ((back.float() - x.float()).abs() <= scale.float()).all()


# ---------------------------------------------------------------------------- paged attention

BLOCK = 4


def reference_attention(q, k, v, computed, sliding_window, scale):
    """One request: q (Q, H, D) at positions computed.., k, v (L, H_kv, D) all its context."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # (H, L, D)
    values = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
    queries = q.transpose(0, 1).double()
    query_pos = computed + torch.arange(q.shape[0])[:, None]
    positions = torch.arange(k.shape[0])[None, :]
    mask = positions <= query_pos
    if sliding_window is not None:
        mask &= positions > query_pos - sliding_window
    scores = (queries @ keys.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1).float()


def run_paged_step(requests, num_heads, num_kv_heads, head_dim, sliding_window, int8, seed=0):
    """requests: (context_len, query_len) each. Writes each request's earlier tokens to a paged
    cache (blocks scattered), runs one step of the torch backend over the new tokens -> (out,
    per-request q/k/v/computed for the reference, the K/V as the cache holds them)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-length // BLOCK) for length, _ in requests)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: padding
    backend = TorchPagedAttention([sliding_window], token_bytes=1 << 16)  # several decode groups
    if int8:
        spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK, torch.int8, torch.float32)
    else:
        spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK, torch.float32)
    [cache] = spec.allocate(num_blocks, torch.device("cpu"), backend)

    def write(k, v, slots):
        if int8:
            write_quantized_kv_cache(k, v, cache, slots)
        else:
            write_kv_cache(k, v, cache[0], cache[1], slots)

    width = max(-(-length // BLOCK) for length, _ in requests)
    tables = np.zeros((len(requests), width), np.int32)
    used, data, step_slots, qsl = 0, [], [], [0]
    for r, (length, query_len) in enumerate(requests):
        nb = -(-length // BLOCK)
        tables[r, :nb] = order[used : used + nb].numpy()
        used += nb
        slots = torch.from_numpy(tables[r]).long()[torch.arange(length) // BLOCK] * BLOCK
        slots += torch.arange(length) % BLOCK
        k = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        q = torch.randn(query_len, num_heads, head_dim, generator=generator)
        computed = length - query_len
        if computed:
            write(k[:computed], v[:computed], slots[:computed])
        data.append((q, k, v, computed))
        step_slots.append(slots[computed:])
        qsl.append(qsl[-1] + query_len)
    inputs = AttentionInputs(
        slot_mapping=torch.cat(step_slots),
        query_start_loc=np.array(qsl),
        num_computed_tokens=np.array([c for *_, c in data]),
        seq_lens=np.array([length for length, _ in requests]),
        block_tables=tables,
        block_size=BLOCK,
    )
    meta = backend.build_metadata(inputs)
    layer = SimpleNamespace(scale=head_dim**-0.5, sliding_window=sliding_window, logit_softcap=None)
    q = torch.cat([d[0] for d in data])
    k = torch.cat([d[1][d[3] :] for d in data])
    v = torch.cat([d[2][d[3] :] for d in data])
    out = backend.forward(layer, q, k, v, cache, meta)

    def held(x):  # the values as the cache holds them
        return dequantize_int8(*quantize_int8(x, torch.float32), torch.float32) if int8 else x

    return out, data, meta, held


CASES = {
    # (context length, query length) per request: 1 is a decode row
    "decode groups": [(5, 1), (37, 1), (1, 1), (64, 1), (17, 1), (90, 1), (9, 1)],
    "prefills with a cached prefix": [(20, 7), (33, 2), (12, 12), (41, 1), (8, 3)],
    "fresh prefills": [(15, 15), (6, 6), (30, 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (8, 2, None), (4, 2, 6)])
def test_int8_paged_attention_matches_the_float_reference(case, heads, kv_heads, window):
    head_dim = 64 if heads == 4 else 32
    requests = CASES[case]
    out, data, meta, held = run_paged_step(requests, heads, kv_heads, head_dim, window, int8=True)
    if case == "decode groups":
        assert len(meta.decodes) > 1  # sized by token_bytes: several groups of similar lengths
    tight, errors = 0.0, []
    start = 0
    for q, k, v, computed in data:
        ours = out[start : start + len(q)]
        start += len(q)
        scale = head_dim**-0.5
        exact = reference_attention(q, k, v, computed, window, scale)
        as_held = reference_attention(q, held(k), held(v), computed, window, scale)
        tight = max(tight, float((ours - as_held).abs().max()))
        errors.append((ours - exact).abs().flatten())
    # The backend computes attention over exactly the dequantized cache...
    assert tight < 1e-5
    # ...which is within the int8 error of attention over the exact K/V: values ~ N(0, 1),
    # a step of max|x| / 127 ~ 0.02, so half a step ~ 0.01 on a value.
    error = torch.cat(errors)
    assert float(error.max()) < 0.06 and float(error.mean()) < 0.005


def test_float_paged_attention_is_unchanged_by_the_int8_path():
    requests = CASES["prefills with a cached prefix"] + CASES["decode groups"]
    out, data, _, _ = run_paged_step(requests, 4, 2, 32, None, int8=False)
    start = 0
    for q, k, v, computed in data:
        exact = reference_attention(q, k, v, computed, None, 32**-0.5)
        assert torch.allclose(out[start : start + len(q)], exact, atol=1e-5)
        start += len(q)


# ---------------------------------------------------------------------------- the spec, the budget


def spec_for(dtype, kv_cache_dtype, head_dim=64, num_kv_heads=4, layers=6, block_size=16):
    config = SimpleNamespace(
        num_hidden_layers=layers,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        is_encoder=False,
    )
    return KVCacheSpec.for_model(config, block_size, dtype, kv_cache_dtype)


def test_block_bytes_count_the_scales():
    spec = spec_for(torch.float16, "int8")
    assert spec.quantized and spec.cache_dtype == "int8" and spec.scale_dtype == torch.float16
    assert spec.token_bytes == 4 * 64 * 1 + 4 * 2  # int8 elements + one fp16 scale per head
    assert spec.block_bytes == 2 * 6 * 16 * spec.token_bytes
    # The bytes allocated are the bytes counted.
    caches = spec.allocate(3, torch.device("cpu"), TorchPagedAttention())
    assert len(caches) == 6 and all(isinstance(c, QuantizedKVCache) for c in caches)
    c = caches[0]
    assert c.k.shape == (3, 16, 4, 64) and c.k.dtype == torch.int8
    assert c.k_scale.shape == (3, 16, 4, 1) and c.v_scale.dtype == torch.float16
    allocated = sum(t.numel() * t.element_size() for cache in caches for t in cache)
    assert allocated == 3 * spec.block_bytes
    fp = spec_for(torch.float32, "auto")
    assert not fp.quantized and fp.cache_dtype == "float32"
    caches = fp.allocate(3, torch.device("cpu"), TorchPagedAttention())
    assert all(type(c) is tuple and len(c) == 2 for c in caches)
    assert sum(t.nbytes for cache in caches for t in cache) == 3 * fp.block_bytes


@pytest.mark.parametrize(("dtype", "at_least"), [(torch.float16, 1.9), (torch.float32, 3.5)])
def test_a_budget_holds_proportionally_more_int8_blocks(dtype, at_least):
    budget = 64 << 20
    plain = budget // spec_for(dtype, "auto").block_bytes
    int8 = budget // spec_for(dtype, "int8").block_bytes
    assert int8 >= at_least * plain
    assert int8 / plain == pytest.approx(64 * dtype.itemsize / (64 + dtype.itemsize), rel=1e-3)


def test_the_engine_budget_and_startup_log_line(caplog):
    model = str(default_model_path())
    """The budget counts the resolved cache's bytes: `auto` on this float32 model under the native
    decoder is bfloat16, twice float32's blocks; INT8 about 3.8 times. The log line names it."""
    counts = {}
    names = {"float32": "float32", "auto": "bfloat16", "int8": "int8"}
    for cache_dtype, name in names.items():
        with caplog.at_level(logging.INFO, logger="aieng.worker.runner"):
            caplog.clear()
            args = EngineArgs(model=model, kv_cache_memory=8 << 20, kv_cache_dtype=cache_dtype)
            runner = aieng.worker.runner.ModelRunner(create_engine_config(args))
        counts[cache_dtype] = runner.num_blocks
        assert runner.num_blocks == (8 << 20) // runner.kv_spec.block_bytes
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
        tokens = runner.num_blocks * runner.block_size
        assert line.startswith(f"KV cache: {name}, {runner.num_blocks} blocks of 16 tokens = ")
        assert f"= {tokens} tokens" in line
    assert runner.native is not None
    assert counts["auto"] in (2 * counts["float32"], 2 * counts["float32"] + 1)
    assert counts["int8"] >= 3.5 * counts["float32"]  # head_dim 64, float32 model


def test_a_backend_that_reads_no_int8_cache_is_refused(monkeypatch):
    class FloatOnly(TorchPagedAttention):
        name = "float-only"
        kv_cache_dtypes = ("auto",)

    monkeypatch.setattr(aieng.worker.runner, "select_attention_backend", lambda *a: FloatOnly())
    args = EngineArgs(model=str(default_model_path()), kv_cache_memory=1 << 20)
    aieng.worker.runner.ModelRunner(create_engine_config(args))  # a float cache: fine
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8': the attention backend"):
        aieng.worker.runner.ModelRunner(
            create_engine_config(EngineArgs(**{**vars(args), "kv_cache_dtype": "int8"}))
        )


def test_the_flag_reaches_engine_args():
    for command in ("serve", "generate", "bench"):
        parsed = build_parser().parse_args([command, *(["x"] if command == "generate" else [])])
        assert EngineArgs.from_cli_args(parsed).kv_cache_dtype == "auto"
    parsed = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert EngineArgs.from_cli_args(parsed).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        LLM(str(default_model_path()), kv_cache_dtype="fp8")


# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_model(request, tmp_path_factory):
    return request.param, make_model(tmp_path_factory.mktemp(request.param), request.param)


def chunked_perplexity(llm: LLM, ids: list[int], chunk: int) -> float:
    """Teacher-forced perplexity, prefilled in chunks: each chunk reads the earlier tokens'
    K/V from the cache."""
    logprobs = llm.engine.runner.prompt_logprobs(ids, chunk_size=chunk)
    return math.exp(-float(logprobs.double().mean()))


def test_four_architectures_int8_close_to_float(arch_model):
    arch, folder = arch_model
    fp = LLM(str(folder), **ENGINE)
    int8 = LLM(str(folder), kv_cache_dtype="int8", **ENGINE)
    # Greedy: mostly the same tokens, and where a continuation parts, it parts at a near tie
    # (these random models' distributions are flat: the top token has p ~ 0.03).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    common = 0
    for x, y in zip(
        fp.generate(PROMPTS, params, use_tqdm=False),
        int8.generate(PROMPTS, params, use_tqdm=False),
        strict=True,
    ):
        a, b = x.outputs[0], y.outputs[0]
        pairs = enumerate(zip(a.token_ids, b.token_ids, strict=True))
        parted = next((i for i, (s, t) in pairs if s != t), None)
        common += MAX_TOKENS if parted is None else parted
        if parted is not None:
            ours, theirs = a.token_ids[parted], b.token_ids[parted]
            assert a.logprobs[parted][ours] - a.logprobs[parted].get(theirs, -1e9) < 0.1, arch
            assert b.logprobs[parted][theirs] - b.logprobs[parted].get(ours, -1e9) < 0.1, arch
    assert common >= 0.6 * len(PROMPTS) * MAX_TOKENS, arch
    # Teacher-forced perplexity of a fixed text, chunked so that later chunks read the cache.
    ids = fp.get_tokenizer().encode(TEXT)
    assert 100 < len(ids) <= 256
    base = chunked_perplexity(fp, ids, 16)
    ours = chunked_perplexity(int8, ids, 16)
    assert ours <= base * 1.005, (arch, base, ours)
    assert ours == pytest.approx(base, rel=5e-3)
    # Fresh prefills see the K/V as the cache holds them: one whole prefill scores the same as
    # chunks that read the cache.
    assert chunked_perplexity(int8, ids, len(ids)) == pytest.approx(ours, rel=1e-5)
    fp.engine.check_pool_whole()
    int8.engine.check_pool_whole()


def test_default_model_perplexity_with_int8_cache(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((TEXT + " ") * 8, encoding="utf-8")
    model = default_model_path()
    base = perplexity(model, text, window=256, stride=128)
    ours = perplexity(model, text, window=256, stride=128, kv_cache_dtype="int8")
    assert ours.tokens == base.tokens
    assert ours.perplexity <= base.perplexity * 1.005, (base.perplexity, ours.perplexity)


@pytest.fixture(scope="module")
def llama_int8(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("llama"), "llama")
    reference = LLM(str(folder), kv_cache_dtype="int8", enable_prefix_caching=False, **ENGINE)
    outputs = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    return folder, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("chunk", [0, 3])
def test_preemption_with_int8_cache_keeps_the_pool_whole(llama_int8, chunk):
    folder, expected = llama_int8
    # 2 layers x 2 (K, V) x 4 tokens x 2 kv heads x (16 int8 + one 4-byte scale) = 640 bytes.
    llm = LLM(
        str(folder),
        kv_cache_dtype="int8",
        kv_cache_memory=20 * 640,
        block_size=4,
        long_prefill_token_threshold=chunk,
    )
    assert llm.engine.runner.block_bytes == 640 and llm.engine.runner.num_blocks == 20
    outputs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    assert llm.engine.core.stats()["num_preemptions"] > 0
    llm.engine.check_pool_whole()
    # Recomputed requests read back what they had: the same tokens as without preemption.
    assert [o.outputs[0].token_ids for o in outputs] == expected * 2


def test_prefix_cache_hits_with_int8_cache_give_the_same_tokens(llama_int8):
    folder, _ = llama_int8
    llm = LLM(str(folder), kv_cache_dtype="int8", **ENGINE)
    tok = llm.get_tokenizer()
    shared = tok.encode(PROMPTS[7])[:16]  # a multiple of the block size
    prompts = [shared, [*shared, 5, 6, 7], [*shared[:9], 11, 12], tok.encode(PROMPTS[6])]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again][:3] == [12, 16, 8]
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm.engine.check_pool_whole()


# ---------------------------------------------------------------------------- /metrics


def test_metrics_report_the_cache_dtype_and_blocks(tmp_path):
    with ThreadServer(make_model_dir(tmp_path), engine={"kv_cache_dtype": "int8"}) as server:
        metrics = server.metrics()
        blocks = server.in_engine(lambda engine: engine.runner.num_blocks)
    assert metrics["aieng_kv_cache_num_blocks"] == blocks
    assert metrics[f"aieng_cache_config_info{{block_size=4,cache_dtype=int8,num_blocks={blocks}}}"]
    config = ModelConfig.from_pretrained(tmp_path)
    per_block = 2 * config.num_hidden_layers * 4 * config.num_key_value_heads
    assert blocks == (1 << 22) // (per_block * (config.head_dim + 4))


def test_metrics_name_the_dtype_auto_resolved_to(tmp_path):
    """`auto` under the native CPU decoder and float32 weights: /metrics says bfloat16."""
    with ThreadServer(make_model_dir(tmp_path)) as server:
        metrics = server.metrics()
        blocks = server.in_engine(lambda engine: engine.runner.num_blocks)
    assert metrics[
        f"aieng_cache_config_info{{block_size=4,cache_dtype=bfloat16,num_blocks={blocks}}}"
    ]
    config = ModelConfig.from_pretrained(tmp_path)
    per_block = 2 * config.num_hidden_layers * 4 * config.num_key_value_heads * config.head_dim
    assert blocks == (1 << 22) // (per_block * 2)  # two bytes an element
