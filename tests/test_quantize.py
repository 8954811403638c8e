"""`aieng quantize`: RTN against compressed-tensors' own quantize/dequantize and packing, the
written checkpoint loaded back (by us and by transformers with the compressed-tensors package),
AWQ against RTN on a tiny model with outlier channels, and the one-line errors of the CLI."""

import json
import math
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from text_fixtures import CORPUS_LINES, byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng.cli import main
from aieng.quantization.packing import unpack_int32
from aieng.quantizer.compressed_tensors_writer import (
    QuantizedWeight,
    QuantScheme,
    compress,
    quantization_config,
    write_checkpoint,
)
from aieng.quantizer.quantize import (
    QuantizeError,
    QuantizeOptions,
    bundled_calibration_text,
    calibration_ids,
    fake_quantize,
    quantize_checkpoint,
    quantize_rtn,
    quantize_with,
    rtn_qparams,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine the thread pool's
    hand-offs cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SCHEMES = [
    QuantScheme(4, 32, False),
    QuantScheme(4, 32, True),
    QuantScheme(4, None, False),
    QuantScheme(4, None, True),
    QuantScheme(8, 64, False),
    QuantScheme(8, None, True),
]
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args(scheme: QuantScheme) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=scheme.bits,
        type="int",
        symmetric=scheme.symmetric,
        group_size=scheme.group_size,
        strategy=scheme.strategy,
    )


def _weight(out: int = 40, columns: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, columns, generator=g)
    w[:, 5] *= 30  # an outlier column
    w[3] = 0  # an all-zero row: zero scales
    w[7] = w[7].abs()  # a row with no negative values: lo clamped to 0
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rtn_matches_compressed_tensors(scheme):
    w = _weight()
    args = _args(scheme)
    scale, zero_point = rtn_qparams(w, scheme)
    # The observer's min/max per group, through compressed-tensors' own qparams.
    groups = w.reshape(w.shape[0], -1, scheme.group_width(w.shape[1]))
    ct_scale, ct_zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    assert torch.equal(scale, ct_scale)
    if scheme.symmetric:
        assert zero_point is None and not ct_zp.any()
    else:
        assert torch.equal(zero_point, ct_zp.to(torch.int8))
    q = quantize_with(w, scale, zero_point, scheme)
    ct_q = quantize(w, ct_scale, ct_zp, args, dtype=torch.int8)
    assert torch.equal(q, ct_q)
    assert int(q.min()) >= scheme.q_min and int(q.max()) <= scheme.q_max
    weight = QuantizedWeight(q, scale, zero_point)
    ct_w = dequantize(ct_q, ct_scale, ct_zp, args)
    assert torch.equal(weight.dequantize(), ct_w)
    assert torch.equal(quantize_rtn(w, scheme).dequantize(), ct_w)
    assert torch.equal(fake_quantize(w, scheme), ct_w)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_writer_matches_packed_compressor(scheme):
    w = _weight(out=36, columns=192)  # 36 rows: the zero points' packed dim is not whole words
    weight = quantize_rtn(w, scheme)
    state = {"weight": w, "weight_scale": weight.scale}
    if not scheme.symmetric:
        state["weight_zero_point"] = weight.zero_point
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=_args(scheme))
    expected = PackedQuantizationCompressor.compress(state, ct_scheme)
    ours = compress(weight, scheme)
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name
    # And the library decompresses ours to our dequantized weight.
    back = PackedQuantizationCompressor.decompress(ours, ct_scheme)
    assert torch.equal(back["weight"], weight.dequantize())


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_quantization_config_is_what_compressed_tensors_reads_and_writes(scheme):
    ours = quantization_config(scheme, ["lm_head"])
    parsed = QuantizationConfig.model_validate(ours)
    dumped = parsed.model_dump()
    for key, value in dumped.items():
        assert ours.get(key) == value, key  # e.g. moe_sparsity_config: None, absent here
    assert parsed.config_groups["group_0"].weights.strategy == scheme.strategy


def test_round_trip_write_read_unpack(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for scheme in (QuantScheme(4, 32, False), QuantScheme(8, None, True)):
        weights = {
            "a.q_proj": quantize_rtn(_weight(40, 128, 1), scheme, torch.bfloat16),
            "a.down_proj": quantize_rtn(_weight(9, 64, 2), scheme, torch.bfloat16),
        }
        norm = torch.rand(64, dtype=torch.bfloat16)
        out = tmp_path / f"out{scheme.bits}"
        write_checkpoint(out, source, {"a.norm.weight": norm}, weights, scheme, ["lm_head"])
        stored = load_file(out / "model.safetensors")
        assert torch.equal(stored.pop("a.norm.weight"), norm)
        offset = 1 << (scheme.bits - 1)
        for layer, weight in weights.items():
            rows, columns = weight.q.shape
            shape = stored.pop(f"{layer}.weight_shape")
            assert shape.dtype == torch.int64 and shape.tolist() == [rows, columns]
            packed = stored.pop(f"{layer}.weight_packed")
            assert packed.dtype == torch.int32
            assert packed.shape == (rows, math.ceil(columns * scheme.bits / 32))
            q = unpack_int32(packed, scheme.bits, dim=1, size=columns) - offset
            assert torch.equal(q.to(torch.int8), weight.q)
            scale = stored.pop(f"{layer}.weight_scale")
            assert scale.dtype == torch.bfloat16 and torch.equal(scale, weight.scale)
            if scheme.symmetric:
                continue
            zp = stored.pop(f"{layer}.weight_zero_point")
            assert zp.shape == (math.ceil(rows * scheme.bits / 32), scale.shape[1])
            zp = unpack_int32(zp, scheme.bits, dim=0, size=rows) - offset
            assert torch.equal(zp.to(torch.int8), weight.zero_point)
        assert not stored
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"] == quantization_config(scheme, ["lm_head"])


# --- whole checkpoints ----------------------------------------------------------------------


def _tiny(
    folder: Path,
    arch: str = "llama",
    outliers: bool = False,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """A tiny checkpoint (64 hidden, 128 MLP, 2 layers) with a trained byte-level tokenizer.
    outliers: a few hidden channels made 25x larger by the norms, as trained LLMs have."""
    build_checkpoint(arch, folder, vocab_size=600, num_key_value_heads=4, **overrides)
    save_model_dir(folder, byte_level_bpe(600))
    tensors = load_file(folder / "model.safetensors")
    for name, tensor in tensors.items():
        if outliers and name.endswith("layernorm.weight"):
            tensor[[3, 17, 40, 41]] *= 25
        tensors[name] = tensor.to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(CORPUS_LINES * 3), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("outlier") / "model", outliers=True)


def _options(method: str, scheme: QuantScheme, calib: Path, **kw) -> QuantizeOptions:
    return QuantizeOptions(
        method=method, scheme=scheme, calib=calib, num_samples=8, seq_len=48, measure=True, **kw
    )


def _dequantized(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every quantized weight unpacked and dequantized (in the
    scales' dtype, or `dtype`)."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    bits, offset = weights["num_bits"], 1 << (weights["num_bits"] - 1)
    stored = load_file(folder / "model.safetensors")
    result = {}
    for name in list(stored):
        if not name.endswith(".weight_packed"):
            continue
        layer = name.removesuffix(".weight_packed")
        rows, columns = stored.pop(f"{layer}.weight_shape").tolist()
        q = unpack_int32(stored.pop(name), bits, dim=1, size=columns) - offset
        zp = stored.pop(f"{layer}.weight_zero_point", None)
        if zp is not None:
            zp = unpack_int32(zp, bits, dim=0, size=rows) - offset
        scale = stored.pop(f"{layer}.weight_scale")
        scale = scale if dtype is None else scale.to(dtype)
        result[f"{layer}.weight"] = QuantizedWeight(q, scale, zp).dequantize()
    return {**stored, **result}


def test_awq_layer_error_not_above_rtn(outlier_model, calib_file, tmp_path):
    scheme = QuantScheme(4, 32, False)
    rtn = quantize_checkpoint(
        outlier_model, tmp_path / "rtn", _options("rtn", scheme, calib_file), None
    )
    awq = quantize_checkpoint(
        outlier_model, tmp_path / "awq", _options("awq", scheme, calib_file), None
    )
    clip = quantize_checkpoint(
        outlier_model, tmp_path / "clip", _options("awq", scheme, calib_file, clip=True), None
    )
    print("layer output MSE  rtn", rtn.layer_errors, "awq", awq.layer_errors)
    print("awq+clip", clip.layer_errors, "alphas", awq.alphas)
    assert awq.calibration_sequences == 8 and len(awq.layer_errors) == 2
    for r, a, c in zip(rtn.layer_errors, awq.layer_errors, clip.layer_errors, strict=True):
        assert a <= r and c <= r
    assert sum(awq.layer_errors) < 0.8 * sum(rtn.layer_errors)
    assert any(alpha > 0 for chosen in awq.alphas for alpha in chosen.values())
    assert set(awq.alphas[0]) == {"qkv", "o", "gate_up", "down"}  # v -> o: kv heads == heads


def test_rtn_checkpoint_round_trip(outlier_model, tmp_path):
    """quantize -> save -> read back -> unpack gives exactly RTN of the source weights."""
    for scheme in (QuantScheme(4, 32, False), QuantScheme(8, None, True)):
        out = tmp_path / f"rtn{scheme.bits}"
        result = quantize_checkpoint(outlier_model, out, QuantizeOptions("rtn", scheme), None)
        assert result.linears == 2 * len(LINEAR_NAMES)
        source = load_file(outlier_model / "model.safetensors")
        written = _dequantized(out)
        assert sorted(written) == sorted(source)
        for name, tensor in source.items():
            if name.rpartition(".")[0].endswith(LINEAR_NAMES):
                assert torch.equal(written[name], quantize_rtn(tensor, scheme).dequantize()), name
            else:
                assert torch.equal(written[name], tensor), name
        for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (out / file).read_bytes() == (outlier_model / file).read_bytes()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize(
    ("arch", "scheme", "clip"),
    [
        ("llama", QuantScheme(4, 32, False), True),
        ("qwen2", QuantScheme(4, None, True), False),  # biases on q/k/v, tied embeddings
        ("llama", QuantScheme(8, 64, False), False),
    ],
    ids=str,
)
def test_transformers_and_aieng_load_the_checkpoint(arch, scheme, clip, calib_file, tmp_path):
    """transformers (with compressed-tensors) decompresses our checkpoints to exactly our
    dequantized weights, and aieng's loader reads the same; AWQ's model stays closer to the
    float one than RTN's (a wrong fold would not)."""
    import transformers
    from transformers import CompressedTensorsConfig

    folder = _tiny(tmp_path / "model", arch, outliers=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = calibration_ids(folder, calib_file, 2, 48, None)
    with torch.no_grad():
        want = reference(ids).logits.log_softmax(-1)
    divergence = {}
    for method in ("awq", "rtn"):
        out = tmp_path / method
        quantize_checkpoint(folder, out, _options(method, scheme, calib_file, clip=clip), None)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        ).eval()
        hf_state = hf.state_dict()
        ours = _dequantized(out)
        assert sorted(ours) == sorted(n for n in hf_state if n != "lm_head.weight" or n in ours)
        for name, tensor in ours.items():
            assert torch.equal(hf_state[name], tensor), name
        _assert_aieng_loads(out)
        with torch.no_grad():
            got = hf(ids).logits.log_softmax(-1)
        divergence[method] = float((want.exp() * (want - got)).sum(-1).mean())  # KL(float||q)
    print(arch, scheme, "KL from the float model", divergence)
    assert divergence["awq"] < divergence["rtn"]
    if scheme.bits == 8:
        assert divergence["awq"] < 0.01


def _assert_aieng_loads(folder: Path) -> None:
    """aieng's loader dequantizes (float32) every linear to our float32 dequantization (its
    exact reference: the CPU kernel, which holds bf16 scales, is kept off)."""
    from unittest import mock

    from aieng.layers.linear import Linear
    from aieng.models.loader import load_model
    from aieng.quantization import linear_method
    from aieng.quantization.linear_method import dequantize as aieng_dequantize
    from aieng.quantization.methods import checkpoint_layer_names

    with mock.patch.object(linear_method, "int4_kernel_available", lambda: False):
        model, _ = load_model(folder, dtype=torch.float32)
    ours = _dequantized(folder, torch.float32)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        blocks = aieng_dequantize(module).split(module.output_sizes)
        parts = checkpoint_layer_names(name, model.packed_modules)
        for part, block in zip(parts, blocks, strict=True):
            assert torch.equal(block, ours[f"{part}.weight"]), part
            checked += 1
    assert checked == 2 * len(LINEAR_NAMES)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_bfloat16_checkpoint(calib_file, tmp_path):
    """A bfloat16 source: scales and float tensors stay bfloat16 (untouched ones bit for bit),
    and transformers decompresses to our bfloat16 dequantization."""
    import transformers
    from transformers import CompressedTensorsConfig

    folder = _tiny(tmp_path / "model", outliers=True, dtype=torch.bfloat16)
    out = tmp_path / "awq"
    scheme = QuantScheme(4, 32, False)
    quantize_checkpoint(folder, out, _options("awq", scheme, calib_file), None)
    source, ours = load_file(folder / "model.safetensors"), _dequantized(out)
    stored = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for n, t in stored.items() if "weight_scale" in n)
    assert torch.equal(ours["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert not torch.equal(  # AWQ folded its scales into the norm
        ours["model.layers.0.input_layernorm.weight"],
        source["model.layers.0.input_layernorm.weight"],
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    hf_state = hf.state_dict()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(hf_state[name], tensor), name
    _assert_aieng_loads(out)


def test_bundled_calibration_fills_the_default_sequences():
    from aieng.config.default_model import default_model_path

    folder = default_model_path()
    text = bundled_calibration_text()
    assert text.is_file() and text.stat().st_size < 400_000
    ids = calibration_ids(folder, text, 128, 512, 0)
    assert ids.shape == (128, 512)
    assert len({tuple(row[:8].tolist()) for row in ids}) == 128  # distinct windows


# --- the command line -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("plain") / "model")


def _cli_error(capsys, *argv: str) -> str:
    status = main(["quantize", *argv])
    captured = capsys.readouterr()
    assert status == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("aieng quantize: error: ")
    return lines[0].removeprefix("aieng quantize: error: ")


def test_cli_quantizes_with_progress(plain_model, calib_file, tmp_path, capsys):
    out = tmp_path / "q"
    argv = [str(plain_model), "--out", str(out), "--group-size", "32", "--calib", str(calib_file)]
    status = main(["quantize", *argv, "--num-samples", "4", "--seq-len", "32"])
    captured = capsys.readouterr()
    assert status == 0
    assert "AWQ layer 2/2" in captured.err and "AWQ layer 1/2" in captured.err
    assert captured.out.startswith(f"wrote {out}: 14 linear weights AWQ INT4 asymmetric")
    assert "layer output MSE" in captured.out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    # Already quantized:
    message = _cli_error(capsys, str(out), "--out", str(tmp_path / "again"), "--method", "rtn")
    assert "is already quantized" in message and "compressed-tensors" in message
    # --out not empty:
    message = _cli_error(capsys, str(plain_model), "--out", str(out), "--method", "rtn")
    assert message == f"--out {out} exists and is not empty"


def test_cli_errors(plain_model, tmp_path, capsys):
    out = str(tmp_path / "out")
    model = str(plain_model)
    assert _cli_error(capsys, model, "--out", out, "--bits", "3") == (
        "--bits 3 is not supported (4 or 8)"
    )
    assert _cli_error(capsys, model, "--out", out, "--group-size", "48") == (
        "--group-size 48 does not divide the 64 input features of "
        "model.layers.0.self_attn.q_proj (use --group-size 64, or -1 for one group per row)"
    )
    missing = str(tmp_path / "nowhere")
    assert _cli_error(capsys, missing, "--out", out) == f"model folder not found: {missing}"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert _cli_error(capsys, model, "--out", out, "--calib", str(empty), "--group-size", "32") == (
        f"calibration file {empty} holds no text"
    )
    short = tmp_path / "short.txt"
    short.write_text("In the beginning")
    message = _cli_error(capsys, model, "--out", out, "--calib", str(short), "--group-size", "32")
    assert message.startswith(f"calibration file {short} has ") and "--seq-len 256" in message
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", model, "--out", out, "--group-size", "x"])
    assert exit_info.value.code == 2
    assert "argument --group-size" in capsys.readouterr().err


def test_cli_help_and_error_as_a_process(plain_model, tmp_path):
    import subprocess
    import sys

    def aieng(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "aieng", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done = aieng("--help")
    assert done.returncode == 0 and "quantize" in done.stdout
    done = aieng("quantize", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: aieng quantize")
    for flag in ("--out", "--method", "--bits", "--group-size", "--symmetric", "--calib"):
        assert flag in done.stdout
    done = aieng("quantize", str(plain_model), "--out", str(tmp_path / "q"), "--bits", "3")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr == "aieng quantize: error: --bits 3 is not supported (4 or 8)\n"


def test_lm_head_quantized_on_request(tmp_path):
    """--quantize-lm-head: the head is written quantized (and left out of `ignore`), aieng loads
    it with a quantized method; a head tied to the embeddings gets its own quantized copy (the
    checkpoint is written untied, the embeddings float)."""
    from unittest import mock

    from aieng.layers.linear import Linear
    from aieng.models.loader import load_model
    from aieng.quantization import linear_method
    from aieng.quantization.linear_method import QuantizedLinearMethod
    from aieng.quantization.linear_method import dequantize as aieng_dequantize

    source = _tiny(tmp_path / "untied", tie_word_embeddings=False)
    out = tmp_path / "int4"
    scheme = QuantScheme(4, 32, False)
    options = QuantizeOptions("rtn", scheme, quantize_lm_head=True)
    quantize_checkpoint(source, out, options, None)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == []
    with mock.patch.object(linear_method, "int4_kernel_available", lambda: False):
        model, _ = load_model(out)
    head = model.lm_head
    assert isinstance(head, Linear) and isinstance(head.method, QuantizedLinearMethod)
    expected = quantize_rtn(load_file(source / "model.safetensors")["lm_head.weight"], scheme)
    assert torch.equal(aieng_dequantize(head), expected.dequantize())

    tied = _tiny(tmp_path / "tied", arch="qwen2")
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"]
    tied_out = tmp_path / "tied-int4"
    quantize_checkpoint(tied, tied_out, options, None)
    written = json.loads((tied_out / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    assert written["quantization_config"]["ignore"] == []
    float_embeddings = load_file(tied / "model.safetensors")["model.embed_tokens.weight"]
    stored = load_file(tied_out / "model.safetensors")
    assert torch.equal(stored["model.embed_tokens.weight"], float_embeddings)
    assert "lm_head.weight" not in stored and "lm_head.weight_packed" in stored
    with mock.patch.object(linear_method, "int4_kernel_available", lambda: False):
        model, _ = load_model(tied_out)
    assert isinstance(model.lm_head.method, QuantizedLinearMethod)
    expected = quantize_rtn(float_embeddings, scheme).dequantize()
    assert torch.equal(aieng_dequantize(model.lm_head), expected)


def test_awq_refuses_post_norm_architectures(tmp_path, calib_file):
    """OLMo 2 normalises after attention and the MLP: there is no norm before q/k/v or gate/up
    to fold AWQ's scales into, so calibration is refused in one line; RTN still works."""
    import transformers

    config = transformers.Olmo2Config(
        vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    folder = tmp_path / "olmo2"
    transformers.Olmo2ForCausalLM(config).save_pretrained(folder)
    save_model_dir(folder, byte_level_bpe(600))
    with pytest.raises(QuantizeError, match=r"post-norms.*use --method rtn"):
        quantize_checkpoint(
            folder, tmp_path / "awq", _options("awq", QuantScheme(4, 32, False), calib_file), None
        )
    quantize_checkpoint(
        folder, tmp_path / "rtn", QuantizeOptions("rtn", QuantScheme(4, 32, False)), None
    )


def test_largest_group_size_divides_every_input_width():
    from aieng.config.default_model import default_model_path
    from aieng.config.model_config import ModelConfig
    from aieng.quantizer.quantize import largest_group_size

    config = ModelConfig.from_pretrained(default_model_path())  # MLP width 704 = 5.5 x 128
    assert largest_group_size(config) == 64
    with pytest.raises(QuantizeError, match="no group size"):
        largest_group_size(config, candidates=(128, 256))
