"""The runner's seams: an attention backend and a linear method written here, outside the model
files, run the model and give HF's greedy tokens — proof that a new backend or weight format
needs no change to `aieng.models`."""

import functools

import pytest
import torch
import torch.nn.functional as F
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, build_checkpoint, hf_greedy, load_hf
from torch import nn

import aieng.worker.runner
from aieng.attention import AttentionBackend, AttentionInputs
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.layers.linear import LinearMethod, WeightLoadError, set_weight_attrs
from aieng.models.loader import load_model
from aieng.sampling import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)


class LoopAttention(AttentionBackend):
    """Attention one request at a time, reading each request's K/V back token by token from a
    cache laid out (blocks, H_kv, block_size, D) — another layout than the reference's."""

    name = "loop"

    def __init__(self):
        self.metadata_builds = 0
        self.layer_calls = 0

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, inputs: AttentionInputs):
        self.metadata_builds += 1
        return inputs

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionInputs):
        self.layer_calls += 1
        k_cache, v_cache = kv_cache
        bs = meta.block_size
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        out = torch.empty_like(q)
        qsl = meta.query_start_loc.tolist()
        for r in range(len(qsl) - 1):
            length = int(meta.seq_lens[r])
            positions = torch.arange(length)
            table = torch.as_tensor(meta.block_tables[r], dtype=torch.long)
            keys = k_cache[table[positions // bs], :, positions % bs]  # (L, H_kv, D)
            values = v_cache[table[positions // bs], :, positions % bs]
            group = layer.num_heads // layer.num_kv_heads
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            queries = q[qsl[r] : qsl[r + 1]].transpose(0, 1)  # (H, Q, D)
            query_pos = int(meta.num_computed_tokens[r]) + torch.arange(queries.shape[1])
            mask = positions[None, :] <= query_pos[:, None]
            if layer.sliding_window is not None:
                mask &= positions[None, :] > query_pos[:, None] - layer.sliding_window
            scores = queries @ keys.transpose(1, 2) * layer.scale
            scores = scores.masked_fill(~mask, float("-inf"))
            out[qsl[r] : qsl[r + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
        return out


class TransposedLinear(LinearMethod):
    """Holds W transposed, (in, out), and places each checkpoint shard along dim 1."""

    def __init__(self):
        self.applied = 0

    def create_weights(self, layer, input_size, output_sizes, bias, dtype):
        weight = nn.Parameter(torch.empty(input_size, sum(output_sizes), dtype=dtype))
        starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

        def load(param, loaded, shard_id):
            shard = 0 if shard_id is None else shard_id
            target = param.data.narrow(1, starts[shard], output_sizes[shard])
            if tuple(loaded.shape) != (output_sizes[shard], input_size):
                raise WeightLoadError(f"has shape {list(loaded.shape)}")
            target.copy_(loaded.t())

        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, weight_loader=load, num_shards=len(output_sizes))
        if bias:
            b = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype))

            def load_bias(param, loaded, shard_id):
                shard = 0 if shard_id is None else shard_id
                param.data.narrow(0, starts[shard], output_sizes[shard]).copy_(loaded)

            layer.register_parameter("bias", b)
            set_weight_attrs(b, weight_loader=load_bias, num_shards=len(output_sizes))
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer, x):
        self.applied += 1
        out = x @ layer.weight
        return out if layer.bias is None else out + layer.bias


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fake_backend_and_linear_method_match_hf(arch, tmp_path, monkeypatch):
    folder = build_checkpoint(arch, tmp_path / arch)
    backend, method = LoopAttention(), TransposedLinear()
    monkeypatch.setattr(aieng.worker.runner, "select_attention_backend", lambda *args: backend)
    monkeypatch.setattr(
        aieng.worker.runner,
        "load_model",
        functools.partial(load_model, linear_methods=lambda p: method),
    )
    runner = aieng.worker.runner.ModelRunner(
        create_engine_config(EngineArgs(model=str(folder), block_size=4, kv_cache_memory=1 << 22))
    )
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.method is method and qkv.weight.shape[0] == qkv.input_size
    assert runner.kv_caches[0][0].shape[1:] == (runner.model_config.num_key_value_heads, 4, 16)

    hf = load_hf(folder)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (5, 30)]
    scheduler = CoreDriver(runner, chunk_size=7)
    requests = [scheduler.add(p, GREEDY) for p in prompts]
    scheduler.run()
    for request, prompt in zip(requests, prompts, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
        assert request.output == tokens
        torch.testing.assert_close(
            torch.tensor(request.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )
    num_layers = runner.model_config.num_hidden_layers
    assert backend.layer_calls == backend.metadata_builds * num_layers  # metadata once a step
    assert method.applied > 0


def test_dense_weight_loader_refuses_bad_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_checkpoint("llama", tmp_path / "llama")
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    good = weights[name]
    for bad, message in [
        (good.to(torch.int32), "dtype torch.int32, expected a tensor like torch.float32"),
        (torch.where(good > 0, good, torch.nan), "NaN or infinite"),
        (F.pad(good, (0, 1)), "has shape"),
    ]:
        save_file({**weights, name: bad}, folder / "model.safetensors")
        with pytest.raises(ValueError, match=f"tensor {name} .*{message}"):
            load_model(folder)
