"""Tensor-parallel model sharding: each rank builds and loads only its share of the model, and two
ranks (spawned processes, gloo over tcp://) give the logprobs one process gives — for every
family and layout the shards must cut differently — plus the start-up errors of shapes the ranks
cannot share.

The ranks run an ordinary `ModelRunner` (prompt logprobs: the serving forward, a paged KV cache,
the LM head's gather) after `init_tensor_parallel`, exactly as the tensor-parallel executor's
workers do; all cases share one spawn (a rank takes seconds to start). Reference: the same runner
in this process, one rank.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import transformers
from quantized_checkpoints import write_awq, write_gptq
from tiny_models import COMMON, QWEN3_MOE, build_checkpoint, save_tiny
from tp_model_ranks import Case, rank_main, score

from aieng.config.model_config import ModelConfig
from aieng.distributed import parallel_state
from aieng.models.gemma import GemmaForCausalLM
from aieng.models.llama import LlamaForCausalLM
from aieng.models.loader import load_model
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint
from aieng.worker.kv_cache import KVCacheSpec

WORLD_SIZE = 2
LENGTHS = (6, 17, 33)
ATOL = 1e-4  # float32 logprobs; only the all-reduce's summation order differs


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


def _gemma2(folder):
    overrides = dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        pad_token_id=0,
        num_hidden_layers=3,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
        attention_bias=True,  # o_proj's bias: added once, by rank 0
        tie_word_embeddings=False,
    )
    return save_tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, overrides, folder)


def _gemma3(folder):  # per-head q/k norms, local/global RoPE, one KV head for two ranks
    overrides = dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        pad_token_id=0,
        num_hidden_layers=4,
        num_key_value_heads=1,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_theta=50000.0,
        rope_local_base_freq=100.0,
        final_logit_softcapping=4.0,
    )
    return save_tiny(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, overrides, folder
    )


def _mixtral(folder):
    overrides = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    return save_tiny(transformers.MixtralConfig, transformers.MixtralForCausalLM, overrides, folder)


def _olmo2(folder):  # q/k norms over all heads, split across the ranks
    overrides = dict(num_key_value_heads=1)  # k norm: over a head both ranks hold
    return save_tiny(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, overrides, folder)


def _qwen3_moe(folder):
    config_cls, model_cls, overrides = QWEN3_MOE
    return save_tiny(config_cls, model_cls, {**overrides, "attention_bias": True}, folder)


def _phi3(folder):  # qkv_proj and gate_up_proj stored fused
    overrides = dict(pad_token_id=0, num_key_value_heads=4)
    return save_tiny(transformers.Phi3Config, transformers.Phi3ForCausalLM, overrides, folder)


def _build_cases(root) -> list[Case]:
    """name -> checkpoint, covering: GQA (Llama); q/k/v biases, tied embeddings, one KV head for
    two ranks and a vocabulary that does not split evenly (Qwen2); per-head q/k norms, a padded
    untied LM head (Qwen3); Gemma 2's soft-caps, scaled embeddings and o_proj bias; Gemma 3's
    per-head q/k norms with one KV head; Phi-3's fused tensors; Qwen3-MoE (biases) and Mixtral,
    experts split within; OLMo 2's q/k norms across all heads; INT4 in three formats."""
    folders = {
        "llama": build_checkpoint("llama", root / "llama"),
        "qwen2_1kv_tied_odd_vocab": build_checkpoint("qwen2", root / "qwen2", vocab_size=253),
        "qwen3_odd_vocab": build_checkpoint("qwen3", root / "qwen3", vocab_size=251),
        "gemma2": _gemma2(root / "gemma2"),
        "phi3_fused": _phi3(root / "phi3"),
        "gemma3_1kv": _gemma3(root / "gemma3"),
        "qwen3_moe": _qwen3_moe(root / "qwen3_moe"),
        "mixtral": _mixtral(root / "mixtral"),
        "olmo2": _olmo2(root / "olmo2"),
    }
    # INT4, asymmetric groups of 32 (zero points packed along the output), the LM head too.
    rtn = QuantizeOptions("rtn", QuantScheme(4, 32, False), quantize_lm_head=True)
    quantize_checkpoint(folders["llama"], root / "int4_rtn", rtn, None)
    folders["int4_rtn"] = root / "int4_rtn"
    write_awq(folders["qwen3_odd_vocab"], root / "awq", root / "awq_ref", group=32)
    folders["int4_awq"] = root / "awq"
    write_gptq(folders["llama"], root / "gptq", root / "gptq_ref", 4, 32, True)
    folders["int4_gptq"] = root / "gptq"
    cases = []
    for i, (name, folder) in enumerate(folders.items()):
        vocab = ModelConfig.from_pretrained(folder).vocab_size
        cases.append(Case(name, str(folder), _prompts(vocab, seed=i)))
    cases.append(Case("llama_chunked", str(folders["llama"]), _prompts(256, 10), chunk_size=5))
    cases.append(
        Case("int4_rtn_cpu_kernel", str(folders["int4_rtn"]), _prompts(256, 11), int4_kernel=True)
    )
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(cases: list[Case], world_size: int, timeout_s: float = 150.0) -> dict:
    """rank -> its results, from `world_size` spawned ranks."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    ranks = [
        ctx.Process(target=rank_main, args=(rank, world_size, port, cases, queue))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        results = {}
        for _ in range(world_size):
            rank, out = queue.get(timeout=timeout_s)
            if isinstance(out, str):
                pytest.fail(f"rank {rank} failed:\n{out}")
            results[rank] = out
        return results
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cases = _build_cases(tmp_path_factory.mktemp("tp"))
    ranks = run_on_ranks(cases, WORLD_SIZE)
    return ranks, score(cases)


CASE_NAMES = [
    "llama",
    "llama_chunked",
    "qwen2_1kv_tied_odd_vocab",
    "qwen3_odd_vocab",
    "gemma2",
    "gemma3_1kv",
    "phi3_fused",
    "qwen3_moe",
    "mixtral",
    "olmo2",
    "int4_rtn",
    "int4_awq",
    "int4_gptq",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_two_ranks_give_the_logprobs_of_one(outcomes, name):
    ranks, single = outcomes
    for rank in range(WORLD_SIZE):
        for got, want in zip(ranks[rank][name], single[name], strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # Every rank holds the same gathered logits.
    for got, want in zip(ranks[1][name], ranks[0][name], strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_cpu_int4_kernel_runs_on_shards(outcomes):
    """torch's INT4 kernel takes bf16 activations: sharding changes where they round, so only a
    bf16-sized tolerance holds (measured: 3e-2 here; a misplaced shard is off by far more)."""
    ranks, single = outcomes
    name = "int4_rtn_cpu_kernel"
    for got, want in zip(ranks[0][name], single[name], strict=True):
        np.testing.assert_allclose(got, want, atol=0.1, rtol=0)


# ---------------------------------------------------------------------------- one rank's share


@pytest.fixture
def as_rank(monkeypatch):
    """Build models as rank r of n without a process group: the constructors and weight loaders
    only read the rank (no collective runs until a forward)."""

    def become(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel_state._state, "rank", rank)
        monkeypatch.setattr(parallel_state._state, "world_size", world_size)

    return become


def _state_dict(folder) -> dict[str, torch.Tensor]:
    model, _ = load_model(folder)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_rank_one_holds_its_heads_columns_and_vocabulary_rows(tmp_path, as_rank):
    folder = build_checkpoint("llama", tmp_path / "llama", attention_bias=True, mlp_bias=True)
    whole = _state_dict(folder)
    as_rank(1, 2)
    model, config = load_model(folder)
    share = model.state_dict()
    d = config.head_dim  # 16; 4 query heads, 2 KV heads, hidden 64, intermediate 128
    qkv = whole["model.layers.0.self_attn.qkv_proj.weight"]
    q, k, v = qkv[:64], qkv[64:96], qkv[96:]
    expected_qkv = torch.cat([q[2 * d :], k[d:], v[d:]])  # query heads 2, 3 and KV head 1
    assert torch.equal(share["model.layers.0.self_attn.qkv_proj.weight"], expected_qkv)
    bias = whole["model.layers.0.self_attn.qkv_proj.bias"]
    expected_bias = torch.cat([bias[2 * d : 64], bias[64 + d : 96], bias[96 + d :]])
    assert torch.equal(share["model.layers.0.self_attn.qkv_proj.bias"], expected_bias)
    o = whole["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(share["model.layers.0.self_attn.o_proj.weight"], o[:, 32:])
    # Row-parallel biases: rank 0 adds them, so the all-reduce adds them once.
    assert not share["model.layers.0.self_attn.o_proj.bias"].any()
    assert not share["model.layers.0.mlp.down_proj.bias"].any()
    gate_up = whole["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(
        share["model.layers.1.mlp.gate_up_proj.weight"],
        torch.cat([gate_up[64:128], gate_up[192:]]),
    )
    down = whole["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(share["model.layers.1.mlp.down_proj.weight"], down[:, 64:])
    assert torch.equal(share["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][128:])
    assert torch.equal(share["lm_head.weight"], whole["lm_head.weight"][128:])
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_heads) == (2, 1, 2)
    assert KVCacheSpec.for_model(config, 4, torch.float32).num_kv_heads == 1


def test_one_kv_head_is_replicated_and_the_last_vocabulary_share_padded(tmp_path, as_rank):
    folder = build_checkpoint("qwen2", tmp_path / "qwen2", vocab_size=253)  # 1 KV head, tied
    whole = _state_dict(folder)
    as_rank(1, 2)
    model, config = load_model(folder)
    share = model.state_dict()
    qkv = whole["model.layers.0.self_attn.qkv_proj.weight"]  # q 64 rows, k 16, v 16
    expected = torch.cat([qkv[32:64], qkv[64:80], qkv[80:]])  # the one KV head, whole
    assert torch.equal(share["model.layers.0.self_attn.qkv_proj.weight"], expected)
    embed = share["model.embed_tokens.weight"]  # rows 127..253 of 2 x 127, one padding row
    assert embed.shape == (127, 64)
    assert torch.equal(embed[:126], whole["model.embed_tokens.weight"][127:])
    assert not embed[126].any()
    assert KVCacheSpec.for_model(config, 4, torch.float32).num_kv_heads == 1


def test_a_fused_phi3_checkpoint_is_split_per_block_then_per_rank(tmp_path, as_rank):
    folder = _phi3(tmp_path / "phi3")
    whole = _state_dict(folder)
    as_rank(0, 2)
    share = load_model(folder)[0].state_dict()
    qkv = whole["model.layers.0.self_attn.qkv_proj.weight"]  # 4 heads of q, k and v: 64 each
    expected = torch.cat([qkv[:32], qkv[64:96], qkv[128:160]])
    assert torch.equal(share["model.layers.0.self_attn.qkv_proj.weight"], expected)
    gate_up = whole["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(
        share["model.layers.0.mlp.gate_up_proj.weight"],
        torch.cat([gate_up[:64], gate_up[128:192]]),
    )


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_shards_dequantize_to_the_whole_layers_slices(tmp_path, as_rank, monkeypatch, fmt):
    """AWQ packs the output dimension, GPTQ the input one: each rank's unpacked weight is its
    slice of the whole layer's."""
    from aieng.quantization import linear_method
    from aieng.quantization.linear_method import dequantize

    monkeypatch.setattr(linear_method, "int4_kernel_available", lambda: False)
    source = build_checkpoint("llama", tmp_path / "float")
    write = write_awq if fmt == "awq" else write_gptq
    write(source, tmp_path / fmt, tmp_path / "ref")
    whole, _ = load_model(tmp_path / fmt)
    as_rank(1, 2)
    share, _ = load_model(tmp_path / fmt)
    layer = "model.layers.0"
    qkv = dequantize(whole.get_submodule(f"{layer}.self_attn.qkv_proj"))
    expected = torch.cat([qkv[32:64], qkv[80:96], qkv[112:]])
    assert torch.equal(dequantize(share.get_submodule(f"{layer}.self_attn.qkv_proj")), expected)
    down = dequantize(whole.get_submodule(f"{layer}.mlp.down_proj"))
    assert torch.equal(dequantize(share.get_submodule(f"{layer}.mlp.down_proj")), down[:, 64:])


# ---------------------------------------------------------------------------- start-up errors


def _config(tmp_path, config_cls=transformers.LlamaConfig, **overrides) -> ModelConfig:
    architecture = config_cls.__name__.removesuffix("Config") + "ForCausalLM"
    config = config_cls(**{**COMMON, **overrides}, architectures=[architecture])
    config.save_pretrained(tmp_path)
    return ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("world_size", "overrides", "message"),
    [
        (3, {}, r"^num_attention_heads: 4 is not divisible by tensor_parallel_size 3$"),
        (
            4,
            dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6),
            r"^num_key_value_heads: 6 is not divisible by tensor_parallel_size 4$",
        ),
        (
            3,
            dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
            r"^num_key_value_heads: 2 KV heads cannot be replicated evenly over "
            r"tensor_parallel_size 3 \(it must be a multiple of them\)$",
        ),
        (
            4,
            dict(intermediate_size=130),
            r"^intermediate_size: 130 is not divisible by tensor_parallel_size 4$",
        ),
    ],
)
def test_shapes_the_ranks_cannot_share_are_one_clear_line(
    tmp_path, as_rank, world_size, overrides, message
):
    config = _config(tmp_path, **overrides)
    as_rank(0, world_size)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config)


def test_gemma_and_moe_shapes_are_checked_too(tmp_path, as_rank):
    gemma = _config(
        tmp_path / "gemma",
        transformers.Gemma2Config,
        hidden_size=96,
        head_dim=16,
        num_attention_heads=6,
    )
    moe = _config(
        tmp_path / "moe",
        transformers.Qwen3MoeConfig,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=30,
    )
    mixtral = _config(
        tmp_path / "mixtral", transformers.MixtralConfig, num_local_experts=4, intermediate_size=30
    )
    as_rank(0, 4)
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"^num_attention_heads: 6 is not divisible by"):
            GemmaForCausalLM(gemma)
        with pytest.raises(ValueError, match=r"^moe_intermediate_size: 30 is not divisible by"):
            LlamaForCausalLM(moe)
        with pytest.raises(ValueError, match=r"^intermediate_size: 30 is not divisible by"):
            LlamaForCausalLM(mixtral)  # Mixtral's experts are `intermediate_size` wide


def test_int4_groups_split_across_ranks_are_refused_naming_the_layer(tmp_path, as_rank):
    source = build_checkpoint("llama", tmp_path / "float")
    options = QuantizeOptions("rtn", QuantScheme(4, 64, False))  # o_proj: 64 inputs, one group
    quantize_checkpoint(source, tmp_path / "int4", options, None)
    as_rank(0, 2)
    with pytest.raises(
        ValueError,
        match=r"^model\.layers\.0\.self_attn\.o_proj \(.*\): tensor_parallel_size 2 splits "
        r"in_features 64 into shards of 32 columns, not a multiple of 64",
    ):
        load_model(tmp_path / "int4")


def test_with_four_ranks_each_pair_shares_a_kv_head(tmp_path, as_rank):
    """4 query heads, 2 KV heads, 4 ranks: rank r holds query head r and KV head r // 2 (the one
    its query head reads); its cache holds that one head."""
    folder = build_checkpoint("llama", tmp_path / "llama")
    qkv = _state_dict(folder)["model.layers.1.self_attn.qkv_proj.weight"]  # q 64, k 32, v 32 rows
    for rank in range(4):
        as_rank(rank, 4)
        model, config = load_model(folder)
        kv = rank // 2
        expected = torch.cat(
            [
                qkv[16 * rank : 16 * (rank + 1)],
                qkv[64 + 16 * kv : 64 + 16 * (kv + 1)],
                qkv[96 + 16 * kv : 96 + 16 * (kv + 1)],
            ]
        )
        share = model.state_dict()["model.layers.1.self_attn.qkv_proj.weight"]
        assert torch.equal(share, expected), rank
        assert KVCacheSpec.for_model(config, 4, torch.float32).num_kv_heads == 1


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.o_proj.weight", [64, 80]),  # more input columns than 64
        ("model.layers.0.self_attn.k_proj.weight", [48, 64]),  # a third KV head
        ("model.embed_tokens.weight", [300, 64]),
    ],
)
def test_a_rank_checks_the_whole_tensor_before_cutting_its_share(tmp_path, as_rank, name, shape):
    """A tensor larger than the config says is refused, not silently cut to the rank's share."""
    from safetensors.torch import load_file, save_file

    folder = build_checkpoint("llama", tmp_path / "llama")
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(shape)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    as_rank(1, 2)
    expected = {
        "model.layers.0.self_attn.o_proj.weight": r"\[64, 64\]",
        "model.layers.0.self_attn.k_proj.weight": r"\[32, 64\]",
        "model.embed_tokens.weight": r"\[256, 64\]",
    }[name]
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \[.*\], expected {expected}"):
        load_model(folder)
