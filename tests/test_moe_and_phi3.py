"""Mixture-of-experts (Qwen3-MoE, Mixtral) and Phi-3 against Hugging Face transformers on tiny
random checkpoints: greedy tokens identical and logprobs within 1e-4, batched, with chunked
prefill and prefix-cache hits; MoE routing deterministic and batch-invariant."""

import json

import pytest
import torch
import transformers
from hf_parity import HFReference, check_batched, check_prefix_hit
from safetensors import safe_open
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import COMMON, QWEN3_MOE, save_tiny

from aieng import LLM, SamplingParams
from aieng.attention.backend import ForwardContext
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.config.model_config import ModelConfig
from aieng.layers.linear import DenseLinearMethod
from aieng.layers.moe import SparseMoE, route
from aieng.layers.rotary import RotaryEmbedding
from aieng.models.llama import LlamaForCausalLM
from aieng.models.loader import load_model
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint

LENGTHS = [1, 5, 12, 17, 26, 30, 31, 40]
# Phi-3's sequences stay within its original context (32 positions). Past it transformers
# rotates the whole sequence with the long factors (recomputing its cache when generation crosses
# that length) and aieng only the positions past it: see aieng.layers.rotary's docstring.
PHI3_LENGTHS = [1, 3, 5, 9, 12, 17, 21, 24]
HEAD_DIM = COMMON["hidden_size"] // COMMON["num_attention_heads"]  # 16
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
    "original_max_position_embeddings": 32,
}

# name -> (config class, model class, overrides)
CHECKPOINTS = {
    "qwen3_moe": QWEN3_MOE,
    # top-3 of 6, renormalised, every second layer sparse (decoder_sparse_step), q/k/v/o bias.
    "qwen3_moe_sparse_step": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # 4 experts, top-2, with a sliding window shorter than the longer prompts.
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=12),
    ),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint; longrope past 32 positions.
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            rope_scaling=LONGROPE,
            original_max_position_embeddings=32,
            pad_token_id=0,
            sliding_window=20,
        ),
    ),
}


def build(name, folder, **extra):
    config_cls, model_cls, overrides = CHECKPOINTS[name]
    return save_tiny(config_cls, model_cls, {**overrides, **extra}, folder)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory):
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    lengths = PHI3_LENGTHS if request.param == "phi3" else LENGTHS
    reference = HFReference(folder, lengths, seed=7)
    reference.name = request.param
    return reference


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_family_matches_hf(reference, chunk_size):
    check_batched(reference, chunk_size)


def test_family_prefix_cache_hit_matches_hf(reference):
    check_prefix_hit(reference, shared_blocks=3, tail=reference.prompts[2])


def test_every_checkpoint_tensor_has_a_parameter(reference):
    """The checkpoint's tensor names (per-expert, or fused for Phi-3) map onto our parameters,
    one to one, through `packed_modules` (HF's own in-memory names differ for experts)."""
    with safe_open(reference.folder / "model.safetensors", "pt") as handle:
        stored = set(handle.keys())
    model = reference.runner.model
    if model.tie_word_embeddings:
        stored.discard("lm_head.weight")
    fused = {part: name for part, (name, _) in LlamaForCausalLM.packed_modules.items()}
    expected = set()
    for name in stored:
        parts = name.split(".")
        parts[-2] = fused.get(parts[-2], parts[-2])
        expected.add(".".join(parts))
    assert {n for n, _ in model.named_parameters()} == expected


def test_moe_layers_follow_the_config(reference):
    config = reference.runner.model.config
    layers = reference.runner.model.model.layers
    sparse = tuple(i for i, layer in enumerate(layers) if isinstance(layer.mlp_module, SparseMoE))
    assert sparse == config.moe_layers
    expected = {
        "qwen3_moe": (0, 2),
        "qwen3_moe_sparse_step": (1, 3),
        "mixtral": (0, 1),
        "phi3": (),
    }[reference.name]
    assert sparse == expected


# --- the MoE layer against transformers' block ----------------------------------------------


def hf_block_and_ours(renormalize: bool):
    config = transformers.Qwen3MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32
    )
    config.norm_topk_prob = renormalize
    torch.manual_seed(1)
    hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        hf.gate.weight.normal_(0, 0.3)
        hf.experts.gate_up_proj.normal_(0, 0.2)
        hf.experts.down_proj.normal_(0, 0.2)
    ours = SparseMoE(64, 32, 8, 3, renormalize, torch.float32, lambda _: DenseLinearMethod(), "mlp")
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
    return hf, ours


@pytest.mark.parametrize("renormalize", [False, True])
def test_sparse_moe_matches_transformers_block(renormalize):
    hf, ours = hf_block_and_ours(renormalize)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(x[None])[0]
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
        _, _, hf_ids = hf.gate(x)
        _, our_ids = route(ours.router_logits(x), 3, renormalize)
    assert torch.equal(our_ids, hf_ids)


def test_sparse_moe_is_batch_invariant_row_by_row():
    _, ours = hf_block_and_ours(True)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        together = ours(x)
        alone = torch.cat([ours(x[i : i + 1]) for i in range(len(x))])
        logits_together = ours.router_logits(x)
        logits_alone = torch.cat([ours.router_logits(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(logits_together, logits_alone)  # so the routing is identical
    # the experts' products may round differently with the number of rows they hold
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert ours(x[:0]).shape == (0, 64)


def test_routing_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = route(logits.to(torch.bfloat16), top_k=2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights, torch.full_like(weights, 0.5))
    # the same ranking however the rows are batched
    assert route(logits[1:], 2, True)[1].tolist() == [[0, 1]]


def test_moe_config_fields_and_refusals():
    def parse(arch, **extra):
        raw = {"architectures": [arch], **COMMON, "num_experts_per_tok": 2, **extra}
        return ModelConfig.from_dicts(raw)

    qwen = parse(
        "Qwen3MoeForCausalLM",
        num_experts=8,
        moe_intermediate_size=16,
        num_hidden_layers=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    assert qwen.moe_layers == (1, 5) and qwen.num_experts == 8 and not qwen.norm_topk_prob
    assert qwen.head_dim == 16 and qwen.qk_norm  # head_dim from the shape, not Qwen3's 128
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    assert parse("Qwen3MoeForCausalLM", num_local_experts=4, moe_intermediate_size=8).num_experts
    mixtral = parse("MixtralForCausalLM", num_local_experts=4, attention_bias=True)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (0, 1)
    assert mixtral.moe_intermediate_size == COMMON["intermediate_size"]
    assert not mixtral.attention_bias and not mixtral.o_proj_bias
    with pytest.raises(ValueError, match=r"'num_experts_per_tok' \(2\) exceeds 'num_experts'"):
        parse("Qwen3MoeForCausalLM", num_experts=1, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="field 'mlp_only_layers' must be a list"):
        parse("Qwen3MoeForCausalLM", num_experts=4, moe_intermediate_size=8, mlp_only_layers=3)
    with pytest.raises(ValueError, match="missing field 'num_local_experts'"):
        parse("MixtralForCausalLM")


def test_moe_checkpoint_quantizes_to_int4_experts(tmp_path):
    """`aieng quantize --method rtn` quantizes every expert; the INT4 model loads through the
    same weight loaders and stays close to the float one. The calibrated AWQ search is refused."""
    source = build("qwen3_moe", tmp_path / "float")
    scheme = QuantScheme(4, 32, symmetric=False)
    out = tmp_path / "int4"
    quantize_checkpoint(source, out, QuantizeOptions(method="rtn", scheme=scheme), progress=None)
    model, _ = load_model(out)
    quantized = {
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "method", None), QuantizedLinearMethod)
    }
    for layer in (0, 2):  # the sparse layers: every expert's two linears
        for expert in range(8):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            assert {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"} <= quantized
    assert "model.layers.1.mlp.gate_up_proj" in quantized  # the dense layer's MLP
    # against the same model with each INT4 layer's dequantized weight in a dense layer
    dense, _ = load_model(source)
    with torch.no_grad():
        for name in quantized:
            dense.get_submodule(name).weight.copy_(dequantize(model.get_submodule(name)))
    ids = torch.randint(3, COMMON["vocab_size"], (24,), generator=torch.Generator().manual_seed(4))
    ctx = ForwardContext(CausalAttention(), DenseBatch(1, len(ids)), None)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(len(ids)), ctx))
        reference = dense.compute_logits(dense(ids, torch.arange(len(ids)), ctx))
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min() > 0.995, cosine
    with pytest.raises(ValueError, match=r"mixture-of-experts layers.*use --method rtn"):
        options = QuantizeOptions(method="awq", scheme=scheme)
        quantize_checkpoint(source, tmp_path / "awq", options, progress=None)


# --- Phi-3 ------------------------------------------------------------------------------------


def test_phi3_old_rope_names_and_longrope_positions():
    raw = json.loads(transformers.Phi3Config(**COMMON, **CHECKPOINTS["phi3"][2]).to_json_string())
    raw["architectures"] = ["Phi3ForCausalLM"]
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = {**LONGROPE, "type": "su"}
    del raw["rope_scaling"]["rope_type"]
    config = ModelConfig.from_dicts(raw)
    assert config.rope.type == "longrope" and config.rope.use_long_factor
    assert config.sliding_window == 20 and not config.attention_bias
    # Positions before the original context rotate with the short factors, later ones with the
    # long factors (what transformers uses for a decode step there).
    rotary = RotaryEmbedding(HEAD_DIM, 64, config.rope)
    wavenumbers = config.rope.theta ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    for position, factors in ((31, "short_factor"), (32, "long_factor"), (63, "long_factor")):
        angle = position / (torch.tensor(LONGROPE[factors]) * wavenumbers)
        scale = config.rope.attention_factor
        torch.testing.assert_close(rotary.cos[position], angle.cos() * scale)
        torch.testing.assert_close(rotary.sin[position], angle.sin() * scale)


# --- the engine: routing is batch-invariant ---------------------------------------------------

VOCAB = 384


@pytest.fixture(scope="module")
def moe_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_engine")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    build("qwen3_moe", folder, vocab_size=VOCAB)
    llm = LLM(
        str(folder),
        kv_cache_memory=1 << 23,
        block_size=8,
        max_num_seqs=32,
        max_num_batched_tokens=128,
    )
    yield llm
    llm.engine.check_pool_whole()


def test_each_request_alone_equals_it_inside_a_batch_of_32(moe_llm):
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, VOCAB, (n,), generator=generator).tolist()
        for n in torch.randint(1, 60, (32,), generator=generator).tolist()
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=3)
    params = [greedy if i % 3 else sampled for i in range(32)]
    batched = moe_llm.generate(prompts, params, use_tqdm=False)
    for i in range(0, 32, 3):  # every third request again, alone
        [alone] = moe_llm.generate([prompts[i + 1]], greedy, use_tqdm=False)
        assert alone.outputs[0].token_ids == batched[i + 1].outputs[0].token_ids
