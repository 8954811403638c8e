"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers on tiny random checkpoints — greedy
tokens identical and logprobs within 1e-4, batched, with chunked prefill and a prefix-cache hit,
prompts longer than the sliding window — and the parts they brought: soft-capped attention and
per-layer sliding windows in both torch backends, the (1 + w) RMSNorm, GELU-tanh, the config
defaults and refusals, an INT8 KV cache."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from core_driver import CoreDriver
from hf_parity import (
    GREEDY,
    HFReference,
    as_our_parameter_names,
    check_batched,
    check_matches,
    check_prefix_hit,
)
from tiny_models import COMMON, hf_greedy, load_hf
from transformers.activations import ACT2FN
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

from aieng.attention.backend import AttentionInputs
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.attention.sdpa import attend
from aieng.attention.selector import select_attention_backend
from aieng.attention.torch_paged import TorchPagedAttention, build_attention_metadata
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.config.model_config import ModelConfig
from aieng.kernels.reference import write_kv_cache
from aieng.layers.activation import gelu_tanh_and_mul
from aieng.layers.linear import DenseLinearMethod, Linear, dense_everywhere
from aieng.layers.norm import RMSNorm
from aieng.layers.rotary import rope_inv_freq
from aieng.models.gemma import GemmaModel
from aieng.quantization import linear_method
from aieng.quantization.linear_method import dequantize
from aieng.quantization.methods import checkpoint_layer_names
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeError, QuantizeOptions, quantize_checkpoint
from aieng.worker.runner import ModelRunner

WINDOW = 8
# Different lengths, several past the window; generation runs 8 tokens further.
LENGTHS = [1, 3, 6, 8, 9, 13, 21, 34]
# config.json fields for the config tests (nothing else given: the defaults apply)
BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4)
TINY = dict(COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, pad_token_id=0)

# name -> (config class, model class, overrides)
CHECKPOINTS = {
    # Local, global, local; both soft-caps low enough to bind on these scores and logits.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(num_hidden_layers=3, attn_logit_softcapping=1.5, final_logit_softcapping=3.0),
    ),
    # q/k/v/o biases, an untied LM head, the default caps (50 and 30).
    "gemma2_bias": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
    ),
    # Local, global, local, global: the global layers' RoPE linearly scaled (factor 8) from
    # theta 50000, the local ones' from base 100; a final soft-cap.
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=4,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_theta=50000.0,
            rope_local_base_freq=100.0,
            final_logit_softcapping=4.0,
        ),
    ),
    # The default pattern (five local, one global), grouped-query 4:1.
    "gemma3_pattern6": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(num_hidden_layers=7, num_key_value_heads=1, rope_theta=10000.0),
    ),
}


def build(name, folder):
    config_cls, model_cls, overrides = CHECKPOINTS[name]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # HF starts the (1 + w) norms at w = 0: random w tests they are loaded
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory):
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    return HFReference(folder, LENGTHS, seed=7)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_gemma_matches_hf(reference, chunk_size):
    check_batched(reference, chunk_size)


def test_gemma_prefix_cache_hit_matches_hf(reference):
    # 3 blocks of 4 (past the window) from the longest prompt, then a new tail.
    check_prefix_hit(reference, shared_blocks=3, tail=reference.prompts[4])


def test_gemma_parameters_are_hf_parameters(reference):
    expected = as_our_parameter_names(n for n, _ in reference.hf.named_parameters())
    ours = {n for n, p in reference.runner.model.named_parameters() if p is not None}
    assert ours == expected


def test_gemma_layers_get_their_windows_caps_and_rope(reference):
    hf_config = reference.hf.config
    config = reference.runner.model_config
    layers = reference.runner.model.model.layers
    for i, (layer, hf_layer) in enumerate(zip(layers, reference.hf.model.layers, strict=True)):
        hf_attn = hf_layer.self_attn
        assert layer.self_attn.attn.sliding_window == hf_attn.sliding_window, i
        assert layer.self_attn.attn.scale == hf_attn.scaling
        # HF's Gemma 3 attention never applies attn_logit_softcapping (kept in its config).
        cap = hf_attn.attn_logit_softcapping if config.architecture == "Gemma2ForCausalLM" else None
        assert layer.self_attn.attn.logit_softcap == cap
    assert reference.runner.attention.sliding_windows == tuple(
        dict.fromkeys(config.layer_sliding_windows)
    )
    if config.architecture == "Gemma3ForCausalLM":
        rotary = reference.hf.model.rotary_emb
        for layer_type, rope in (
            ("full_attention", config.rope),
            ("sliding_attention", config.rope_local),
        ):
            expected = getattr(rotary, f"{layer_type}_inv_freq")
            assert torch.equal(rope_inv_freq(config.head_dim, rope), expected), layer_type
        assert hf_config.layer_types.count("full_attention") >= 1


def test_gemma_with_an_int8_kv_cache_runs(tmp_path, monkeypatch):
    """Soft-capped windowed and global layers over an INT8 cache through the torch runner (the
    native decoder reads it too: tests/test_cpu_native.py); one metadata build per step serves
    all three layers and both windows."""
    folder = build("gemma2", tmp_path / "gemma2")
    args = EngineArgs(
        model=str(folder),
        block_size=4,
        kv_cache_memory=1 << 22,
        kv_cache_dtype="int8",
        cpu_native="off",
    )
    runner = ModelRunner(create_engine_config(args))
    assert runner.kv_spec.quantized
    builds = []
    build_metadata = runner.attention.build_metadata
    monkeypatch.setattr(
        runner.attention,
        "build_metadata",
        lambda inputs: builds.append(1) or build_metadata(inputs),
    )
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 19, 30)]
    scheduler = CoreDriver(runner, chunk_size=6)
    requests = [scheduler.add(p, GREEDY) for p in prompts]
    steps = 0
    while scheduler.step():
        steps += 1
    assert len(builds) == steps
    for request in requests:
        assert len(request.output) == GREEDY.max_tokens
        assert all(0 <= t < 256 for t in request.output)
        assert np.isfinite(request.logprobs).all() and max(request.logprobs) <= 0


def test_gemma_int4_checkpoint_matches_hf_on_the_dequantized_weights(tmp_path, monkeypatch):
    """RTN INT4 through the linear methods (their dequantizing reference; the CPU kernel has its
    own tests): aieng serving the packed checkpoint gives what HF gives with each quantized weight
    replaced by the values aieng's method holds. AWQ is refused (its scales would fold into norms
    that Gemma applies as (1 + w), and into a post-norm)."""
    folder = build("gemma2", tmp_path / "float")
    scheme = QuantScheme(4, 32, False)  # group 32 divides every input width (64, 128)
    with pytest.raises(QuantizeError, match=r"Gemma2ForCausalLM normalises after .*post-norms"):
        quantize_checkpoint(folder, tmp_path / "awq", QuantizeOptions("awq", scheme), None)
    quantize_checkpoint(folder, tmp_path / "int4", QuantizeOptions("rtn", scheme), None)
    monkeypatch.setattr(linear_method, "int4_kernel_available", lambda: False)
    runner = ModelRunner(
        create_engine_config(
            EngineArgs(
                model=str(tmp_path / "int4"),
                block_size=4,
                kv_cache_memory=1 << 22,
                kv_cache_dtype="float32",
                cpu_quant_kernel="int8x2",  # bf16-accurate activations: greedy follows HF
            )
        )
    )
    hf = load_hf(folder)
    model = runner.model
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                assert not isinstance(module.method, DenseLinearMethod), name
                blocks = dequantize(module).split(module.output_sizes)
                parts = checkpoint_layer_names(name, model.packed_modules)
                for part, block in zip(parts, blocks, strict=True):
                    weight = hf.get_parameter(f"{part}.weight")
                    assert not torch.equal(weight, block)  # quantized
                    weight.copy_(block)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (2, 11, 26)]
    scheduler = CoreDriver(runner, chunk_size=5)
    requests = [scheduler.add(p, GREEDY) for p in prompts]
    scheduler.run()
    check_matches(requests, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts])


# ---------------------------------------------------------------------------- layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_offset_rms_norm_is_hf_gemma_norm(dtype):
    hf = Gemma2RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        hf.weight.uniform_(-1, 1)
    ours = RMSNorm(48, 1e-6, dtype, unit_offset=True)
    ours.weight.data.copy_(hf.weight.to(dtype))
    hf = hf.to(dtype)
    x = torch.randn(5, 48).to(dtype) * 3
    assert torch.equal(ours(x), hf(x))
    assert torch.equal(RMSNorm(48, 1e-6, unit_offset=True)(x.float()), Gemma2RMSNorm(48)(x.float()))


def test_embeddings_are_scaled_by_the_normalizer_in_their_dtype():
    # √3072 = 55.43 is 55.5 in bfloat16: HF multiplies by the rounded value.
    raw = dict(BASE, hidden_size=3072, num_hidden_layers=1, head_dim=8)
    raw.update(num_attention_heads=1, num_key_value_heads=1)
    config = ModelConfig.from_dicts({"architectures": ["Gemma3ForCausalLM"], **raw})
    ours = GemmaModel(config, torch.bfloat16, dense_everywhere)
    hf = Gemma3TextScaledWordEmbedding(100, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    ours.embed_tokens.weight.data.copy_(hf.weight)
    ids = torch.arange(100)
    assert torch.equal(ours.embed(ids), hf(ids))
    assert not torch.equal(ours.embed(ids), ours.embed_tokens(ids) * 3072**0.5)


def test_gelu_tanh_and_mul_is_hf_gelu_pytorch_tanh():
    x = torch.randn(7, 2 * 32) * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


# ---------------------------------------------------------------------------- attention


def reference_attention(q, k, v, computed, window, scale, softcap):
    """One request, in float64: q (Q, H, D) at positions computed.., k, v (L, H_kv, D)."""
    group = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # (H, L, D)
    values = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = q.transpose(0, 1).double() @ keys.transpose(1, 2) * scale  # (H, Q, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = computed + torch.arange(q.shape[0])[:, None]
    positions = torch.arange(k.shape[0])[None, :]
    mask = positions <= query_pos
    if window is not None:
        mask &= positions > query_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1).float()  # (Q, H, D)


@pytest.mark.parametrize("causal", [True, False])
def test_softcapped_attend_matches_the_plain_reference(causal):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 6, 16, generator=generator) * 2  # (B, H, Q, D)
    k = torch.randn(3, 2, 6, 16, generator=generator) * 2  # (B, H_kv, L, D): GQA 4:1
    v = torch.randn(3, 2, 6, 16, generator=generator)
    mask = None if causal else torch.rand(3, 1, 6, 6, generator=generator) > 0.3
    if mask is not None:
        mask[..., 0] = True  # every query attends somewhere
    out = attend(q, k, v, mask, causal, 0.25, softcap=2.0)
    keys, values = k.repeat_interleave(4, dim=1).double(), v.repeat_interleave(4, dim=1).double()
    scores = 2.0 * torch.tanh(q.double() @ keys.transpose(-1, -2) * 0.25 / 2.0)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() if causal else mask
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    # Capping matters here: SDPA without it differs.
    plain = attend(q, k, v, mask, causal, 0.25)
    assert (plain - out).abs().max() > 1e-2


BLOCK = 4
# (context length, query length): decodes (1), prefills over a cached prefix, fresh prefills;
# most contexts longer than the window.
STEP = [(5, 1), (23, 1), (40, 1), (17, 1), (30, 7), (12, 12), (9, 3), (3, 3)]


def paged_step(requests, num_heads, num_kv_heads, head_dim, seed=0):
    """Writes each request's earlier tokens to a paged cache (blocks scattered) and builds one
    step's inputs -> (per-request q/k/v/computed, the step's q/k/v, the inputs, the cache)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-length // BLOCK) for length, _ in requests)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: padding
    k_cache = torch.zeros(num_blocks, BLOCK, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    width = max(-(-length // BLOCK) for length, _ in requests)
    tables = np.zeros((len(requests), width), np.int32)
    used, data, step_slots, qsl = 0, [], [], [0]
    for r, (length, query_len) in enumerate(requests):
        nb = -(-length // BLOCK)
        tables[r, :nb] = order[used : used + nb].numpy()
        used += nb
        slots = torch.from_numpy(tables[r]).long()[torch.arange(length) // BLOCK] * BLOCK
        slots += torch.arange(length) % BLOCK
        k = torch.randn(length, num_kv_heads, head_dim, generator=generator) * 2
        v = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        q = torch.randn(query_len, num_heads, head_dim, generator=generator) * 2
        computed = length - query_len
        write_kv_cache(k[:computed], v[:computed], k_cache, v_cache, slots[:computed])
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
    q = torch.cat([d[0] for d in data])
    k = torch.cat([d[1][d[3] :] for d in data])
    v = torch.cat([d[2][d[3] :] for d in data])
    return data, (q, k, v), inputs, (k_cache, v_cache)


def layer(window, softcap, head_dim=16):
    return SimpleNamespace(scale=head_dim**-0.5, sliding_window=window, logit_softcap=softcap)


def test_one_metadata_serves_layers_with_different_windows_and_caps():
    data, (q, k, v), inputs, cache = paged_step(STEP, 8, 2, 16)
    backend = TorchPagedAttention((WINDOW, None, WINDOW), token_bytes=1 << 16)  # several groups
    assert backend.sliding_windows == (WINDOW, None)
    meta = backend.build_metadata(inputs)
    assert len(meta.decodes) > 1
    # Each layer writes the step's K/V again (the same values) and reads its own masks.
    for window, softcap in [(WINDOW, 1.5), (None, 1.5), (WINDOW, None), (None, None)]:
        out = backend.forward(layer(window, softcap), q, k, v, cache, meta)
        start = 0
        for q_r, k_r, v_r, computed in data:
            expected = reference_attention(q_r, k_r, v_r, computed, window, 0.25, softcap)
            torch.testing.assert_close(out[start : start + len(q_r)], expected, atol=1e-5, rtol=0)
            start += len(q_r)


def test_window_masks_are_built_per_window():
    _, qkv, inputs, cache = paged_step([(20, 1), (11, 4), (6, 6)], 4, 2, 16)
    meta = build_attention_metadata(inputs, (WINDOW, None))
    [group] = meta.decodes
    assert group.masks[None] is None  # one decode row: its whole context
    assert group.masks[WINDOW][0, 0, 0].tolist() == [p >= 20 - WINDOW for p in range(20)]
    cached, fresh = meta.prefills
    assert cached.masks[None].tolist() == [[p <= 7 + i for p in range(11)] for i in range(4)]
    assert cached.masks[WINDOW].tolist() == [
        [7 + i - WINDOW < p <= 7 + i for p in range(11)] for i in range(4)
    ]
    assert fresh.masks[None] is None  # causal over its own tokens
    with pytest.raises(ValueError, match="sliding window 5: the attention metadata was built for"):
        TorchPagedAttention((WINDOW, None)).forward(layer(5, None), *qkv, cache, meta)


def test_the_selector_gives_the_backend_every_window(reference):
    config = reference.runner.model_config
    backend = select_attention_backend("torch", config, torch.device("cpu"), torch.float32)
    assert set(backend.sliding_windows) == set(config.layer_sliding_windows)
    mistral = ModelConfig.from_dicts(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "num_hidden_layers": 2,
            "sliding_window": 5,
        }
    )
    assert select_attention_backend(
        "torch", mistral, torch.device("cpu"), torch.float32
    ).sliding_windows == (5,)


@pytest.mark.parametrize("window, softcap", [(None, 1.5), (WINDOW, 1.5), (WINDOW, None)])
def test_the_training_backend_caps_and_windows_per_layer(window, softcap):
    generator = torch.Generator().manual_seed(2)
    b, length = 2, 13
    q = torch.randn(b * length, 4, 16, generator=generator) * 2
    k = torch.randn(b * length, 2, 16, generator=generator) * 2
    v = torch.randn(b * length, 2, 16, generator=generator)
    backend = CausalAttention()
    meta = backend.build_metadata(DenseBatch(b, length))
    out = backend.forward(layer(window, softcap), q, k, v, None, meta)
    for row in range(b):
        rows = slice(row * length, (row + 1) * length)
        expected = reference_attention(q[rows], k[rows], v[rows], 0, window, 0.25, softcap)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- config


def test_absent_fields_take_transformers_gemma_defaults():
    for architecture, hf_cls in (
        ("Gemma2ForCausalLM", transformers.Gemma2Config),
        ("Gemma3ForCausalLM", transformers.Gemma3TextConfig),
    ):
        hf = hf_cls(**BASE, num_hidden_layers=7)
        ours = ModelConfig.from_dicts(
            {"architectures": [architecture], **BASE, "num_hidden_layers": 7}
        )
        assert ours.head_dim == hf.head_dim == 256
        assert ours.num_key_value_heads == hf.num_key_value_heads
        assert ours.tie_word_embeddings and hf.tie_word_embeddings
        assert ours.max_position_embeddings == hf.max_position_embeddings
        assert ours.attention_scale == hf.query_pre_attn_scalar**-0.5
        assert ours.final_logit_softcapping == hf.final_logit_softcapping
        assert ours.layer_sliding_windows == tuple(
            hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types
        )
        assert ours.eos_token_ids == (hf.eos_token_id,) and ours.bos_token_id == hf.bos_token_id
    gemma2 = ModelConfig.from_dicts(
        {"architectures": ["Gemma2ForCausalLM"], **BASE, "num_hidden_layers": 3}
    )
    assert gemma2.attn_logit_softcapping == 50.0 and gemma2.rope_local is None
    assert gemma2.layer_sliding_windows == (4096, None, 4096)


def test_an_old_style_gemma3_config_reads_as_transformers_reads_it():
    raw = {
        **BASE,
        "num_hidden_layers": 12,
        "head_dim": 16,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "hidden_act": "gelu_pytorch_tanh",
    }
    hf = transformers.Gemma3TextConfig(**raw)
    ours = ModelConfig.from_dicts({"architectures": ["Gemma3ForCausalLM"], **raw})
    assert ours.qk_norm
    assert ours.layer_sliding_windows == tuple(
        512 if t == "sliding_attention" else None for t in hf.layer_types
    )
    assert (ours.rope.type, ours.rope.factor, ours.rope.theta) == ("linear", 8.0, 1e6)
    assert (ours.rope_local.type, ours.rope_local.theta) == ("default", 1e4)
    assert hf.rope_parameters["full_attention"]["factor"] == 8.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_activation": "gelu"}, "field 'hidden_activation' = 'gelu' is not supported"),
        ({"layer_types": ["full_attention"] * 2}, "field 'layer_types' must be 3 entries"),
        ({"layer_types": ["sliding_attention", "chunked", "full_attention"]}, "'chunked'"),
        ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' = true"),
        ({"attn_logit_softcapping": -1.0}, "field 'attn_logit_softcapping' must be positive"),
        ({"query_pre_attn_scalar": 0}, "field 'query_pre_attn_scalar' must be positive"),
        ({"sliding_window": 0}, "field 'sliding_window' must be positive"),
        ({"sliding_window": None}, "missing field 'sliding_window'"),
    ],
)
def test_unsupported_gemma_options_are_named_with_their_value(change, message):
    with pytest.raises(ValueError, match=r"config\.json") as error:
        ModelConfig.from_dicts(
            {"architectures": ["Gemma2ForCausalLM"], **BASE, "num_hidden_layers": 3, **change}
        )
    assert message in str(error.value)


def test_gemma3_rope_must_be_keyed_by_layer_type():
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        **BASE,
        "num_hidden_layers": 2,
        "rope_parameters": {"rope_type": "linear", "factor": 8.0},
    }
    with pytest.raises(ValueError, match="field 'rope_parameters' must be keyed by layer type"):
        ModelConfig.from_dicts(raw)
    raw["rope_parameters"] = {"full_attention": {"rope_type": "mrope"}}
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        ModelConfig.from_dicts(raw)


def test_a_saved_gemma3_config_json_round_trips(tmp_path):
    hf = transformers.Gemma3TextConfig(
        **BASE, num_hidden_layers=6, rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    hf.architectures = ["Gemma3ForCausalLM"]
    hf.save_pretrained(tmp_path)
    ours = ModelConfig.from_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (
        ours.rope.factor == 4.0
        and ours.rope.theta == saved["rope_parameters"]["full_attention"]["rope_theta"]
    )
    assert ours.rope_local.theta == saved["rope_parameters"]["sliding_attention"]["rope_theta"]
