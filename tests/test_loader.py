"""Checkpoint loading and config parsing: fused weights, shards, dtypes and clear errors."""

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import build_checkpoint

from aieng.config.model_config import ModelConfig, RopeConfig
from aieng.layers.rotary import rope_inv_freq
from aieng.models.loader import LoadTimes, load_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def broken_dir(llama_dir, tmp_path):
    """A writable copy of the tiny llama checkpoint."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_dir, folder)
    return folder


def rewrite(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_fuses_qkv_and_gate_up(llama_dir):
    model, config = load_model(llama_dir)
    tensors = load_file(llama_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected, rtol=0, atol=0)
    mlp = model.model.layers[0].mlp
    expected = torch.cat([tensors[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    torch.testing.assert_close(mlp.gate_up_proj.weight, expected, rtol=0, atol=0)
    assert config.architecture == "LlamaForCausalLM" and config.head_dim == 16


def test_sharded_checkpoint_matches_single_file(llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, _ = load_model(tmp_path)
    single, _ = load_model(llama_dir)
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), single.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_converts_to_target_dtype_and_logs_times(llama_dir, caplog):
    times = LoadTimes()
    with caplog.at_level(logging.INFO, logger="aieng.models.loader"):
        model, _ = load_model(llama_dir, dtype=torch.bfloat16, times=times)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "read" in caplog.text and "convert and place" in caplog.text
    assert times.reading_s > 0 and times.placing_s > 0 and times.building_s > 0
    assert times.kv_cache_s == 0  # the runner's part
    assert times.describe().startswith(f"model loaded in {times.total_s:.2f} s (build ")


def test_missing_tensor_is_named(broken_dir):
    file = rewrite(broken_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(broken_dir)
    rewrite(broken_dir, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=rf"{file}: missing tensor .*k_proj.* model\.norm\.weight"):
        load_model(broken_dir)


def test_wrong_shape_names_file_and_tensor(broken_dir):
    name = "model.layers.0.mlp.up_proj.weight"
    file = rewrite(broken_dir, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=rf"{file}.*{name}.*shape"):
        load_model(broken_dir)


def test_unexpected_tensor_is_named(broken_dir):
    file = rewrite(broken_dir, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=rf"{file}.*unexpected tensor model\.extra\.weight"):
        load_model(broken_dir)


def test_truncated_file_is_named(broken_dir):
    file = broken_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=str(file)):
        load_model(broken_dir)


def test_missing_shard_file_is_named(llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"index.json.*{shard.name}"):
        load_model(tmp_path)


def test_no_weights_file(broken_dir):
    (broken_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(broken_dir)


def test_unknown_architecture_is_named(broken_dir):
    config_file = broken_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPTNeoForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*GPTNeoForCausalLM"):
        load_model(broken_dir)


BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def test_config_rope_forms_agree():
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    old = ModelConfig.from_dicts(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    new = ModelConfig.from_dicts(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert (
        old.rope
        == new.rope
        == RopeConfig(theta=5e5, type="llama3", **{k: v for k, v in scaling.items()})
    )
    assert (
        ModelConfig.from_dicts(
            {**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}
        ).rope.factor
        == 2.0
    )
    assert old.num_key_value_heads == 4 and old.head_dim == 16


def test_llama3_rope_matches_transformers():
    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "architectures"},
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = ModelConfig.from_dicts({**BASE, **json.loads(hf_config.to_json_string())})
    torch.testing.assert_close(rope_inv_freq(ours.head_dim, ours.rope), expected)


def test_config_fields_and_generation_config(tmp_path):
    raw = {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,
        "num_key_value_heads": 2,
        "eos_token_id": 5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 8], "temperature": 0.6, "top_p": 0.95, "do_sample": True})
    )
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.head_dim == 32 and config.qk_norm and config.tie_word_embeddings
    assert config.eos_token_ids == (7, 8) and config.dtype == "bfloat16"
    assert config.generation_defaults == {"temperature": 0.6, "top_p": 0.95}
    qwen2 = ModelConfig.from_dicts(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 3}
    )
    assert qwen2.attention_bias and qwen2.eos_token_ids == (3,)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
        ({"architectures": []}, "architectures"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path, change, field):
    raw = {**BASE, **change}
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if v is not None})
    )
    with pytest.raises(ValueError, match=rf"config\.json.*{field}"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_or_malformed_config_file(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)
