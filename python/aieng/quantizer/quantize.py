"""`aieng quantize`: weight-only INT4/INT8 quantization of a float checkpoint, by round-to-nearest
(RTN) or AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization"), written as a
compressed-tensors `pack-quantized` checkpoint (`compressed_tensors_writer`).

RTN, per output row and group of `group_size` input columns (the whole row for the channel
strategy), as compressed-tensors' min-max observer and `calculate_qparams` do:
- asymmetric: lo = min(w.min(), 0), hi = max(w.max(), 0), scale = (hi - lo) / (2**b - 1),
  zero_point = round(-2**(b-1) - lo / scale) clamped to [-2**(b-1), 2**(b-1) - 1] (0 for an
  all-zero group, as compressed-tensors stores);
- symmetric: scale = max(|lo|, |hi|) / ((2**b - 1) / 2), no zero point;
then q = round(clamp(w / scale + zero_point, -2**(b-1), 2**(b-1) - 1)) and w ≈ (q - zp) * scale.
The scale is rounded to the model's dtype before q is computed (so q is consistent with the
scale written), and a zero scale becomes the dtype's eps.

AWQ, decoder layer by decoder layer (each layer fed the previous layer's float outputs on the
calibration text): for each group of linears that read the same input — q/k/v after
input_layernorm, o_proj after v_proj (only when num_kv_heads == num_heads: v_proj's output
channels must be o_proj's input channels one for one, which grouped-query attention breaks),
gate/up after post_attention_layernorm, down_proj after up_proj — it takes the mean |x| of each
input channel over the calibration tokens, tries s = mean|x|**alpha for alpha in
{0, 0.05, ..., 0.95} (normalised so that max(s) * min(s) = 1), quantizes W diag(s) by RTN and
keeps the alpha whose module output (the attention block for q/k/v, the MLP for gate/up, the
linear's own output for o_proj and down_proj) on (x / s) is closest to the float output in mean
squared error. alpha = 0 is RTN itself, so the search never does worse than RTN on the group
it scores. The scale is then folded exactly: the preceding RMSNorm's weight (or the preceding
linear's output rows and bias) divided by s, the linear's input columns multiplied by s.
`clip=True` then searches, per output row and group, the clipping of max|w| (1, 0.95, ...,
0.55) that minimises the group's output error on up to 512 calibration tokens (AWQ's
auto_clip; not on q/k, whose errors the attention scores amplify). Embeddings and the LM head
stay float.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from aieng.layers.linear import Linear
from aieng.quantization.methods import checkpoint_layer_names
from aieng.quantizer.compressed_tensors_writer import (
    QuantizedWeight,
    QuantScheme,
    write_checkpoint,
)
from aieng.quantizer.defaults import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN

METHODS = ("awq", "rtn")
CALIBRATION_FILE = "calibration_kjv.txt"
ALPHA_GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512
CLIP_ROWS = 256  # output rows per batch of the clipping search
IGNORE = ["lm_head"]
# Tokens per forward chunk while calibrating (whole sequences; bounds the attention's memory).
CHUNK_TOKENS = 16384


class QuantizeError(ValueError):
    """A bad input to the quantizer: one line, naming what is wrong."""


@dataclass
class QuantizeOptions:
    method: str = "awq"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    calib: str | Path | None = None  # None: the bundled calibration text
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int | None = None  # None: min(512, the model's context)
    clip: bool = False
    # Quantize the LM head too (RTN; it reads the final norm's output, which AWQ does not scale).
    # A tied head gets its own quantized copy; the embeddings stay float.
    quantize_lm_head: bool = False
    # Measure each layer's output error on the calibration text (AWQ and clip always do).
    measure: bool = False


@dataclass
class QuantizeResult:
    out: Path
    method: str
    scheme: QuantScheme
    layers: int  # decoder layers
    linears: int  # checkpoint linear weights quantized
    calibration_sequences: int
    calibration_seq_len: int
    seconds: float
    bytes_written: int
    # Per decoder layer: mean squared error of its output, float input, quantized vs float
    # weights, on the calibration text (empty when not measured).
    layer_errors: list[float] = field(default_factory=list)
    # Per decoder layer: the alpha AWQ chose for each group ("qkv", "o", "gate_up", "down").
    alphas: list[dict[str, float]] = field(default_factory=list)


# --- round to nearest -----------------------------------------------------------------------


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    out, columns = w.shape
    width = scheme.group_width(columns)
    return w.reshape(out, columns // width, width)


def rtn_qparams(
    w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w (out, in) -> (scale (out, groups) in `dtype`, zero point (out, groups) int8 or None)."""
    grouped = _grouped(w.float(), scheme)
    lo = grouped.amin(-1).clamp(max=0)
    hi = grouped.amax(-1).clamp(min=0)
    bit_range = float(scheme.q_max - scheme.q_min)
    if scheme.symmetric:
        scale = torch.maximum(lo.abs(), hi) / (bit_range / 2)
    else:
        scale = (hi - lo) / bit_range
    scale = scale.to(dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)
    if scheme.symmetric:
        return scale, None
    zero_point = (scheme.q_min - lo / scale.float()).clamp(scheme.q_min, scheme.q_max).round()
    # An all-zero group: compressed-tensors computes 0 / 0 there and stores 0; any zero point
    # dequantizes it to 0, so 0 it is, for the same bytes.
    zero_point = torch.where(hi - lo == 0, torch.zeros_like(zero_point), zero_point)
    return scale, zero_point.to(torch.int8)


def quantize_with(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """w (out, in) -> q (out, in) int8 for the given scale and zero point, computed as
    compressed-tensors' `quantize`: round(clamp(w / scale + zero_point)) in float32."""
    grouped = _grouped(w.float(), scheme)
    scaled = grouped / scale.float()[:, :, None]
    if zero_point is not None:
        scaled = scaled + zero_point.float()[:, :, None]
    q = scaled.clamp(scheme.q_min, scheme.q_max).round()
    return q.reshape(w.shape).to(torch.int8)


def quantize_rtn(
    w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype = torch.float32
) -> QuantizedWeight:
    """Round-to-nearest quantization of w (out, in), scales in `dtype`."""
    scale, zero_point = rtn_qparams(w, scheme, dtype)
    return QuantizedWeight(quantize_with(w, scale, zero_point, scheme), scale, zero_point)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """w (out, in) quantized by RTN and dequantized again, float32 scales: the same values as
    `quantize_rtn(w, scheme).dequantize()` (bar scales below float32's eps), in fewer passes
    (the searches call it often)."""
    grouped = _grouped(w.float(), scheme)
    lo, hi = torch.aminmax(grouped, dim=-1, keepdim=True)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    bit_range = float(scheme.q_max - scheme.q_min)
    eps = torch.finfo(torch.float32).eps
    if scheme.symmetric:
        scale = (torch.maximum(-lo, hi) / (bit_range / 2)).clamp_(min=eps)
        q = (grouped / scale).clamp_(scheme.q_min, scheme.q_max).round_()
        return (q * scale).reshape(w.shape)
    scale = ((hi - lo) / bit_range).clamp_(min=eps)
    zero_point = (scheme.q_min - lo / scale).clamp_(scheme.q_min, scheme.q_max).round_()
    zero_point = torch.where(hi - lo == 0, torch.zeros_like(zero_point), zero_point)
    q = (grouped / scale + zero_point).clamp_(scheme.q_min, scheme.q_max).round_()
    return ((q - zero_point) * scale).reshape(w.shape)


# --- calibration ----------------------------------------------------------------------------


def bundled_calibration_text() -> Path:
    """The bundled calibration text: every 14th chapter of the King James Bible (public domain)
    outside the books `aieng train --kjv` holds out, 293 KB."""
    return Path(str(resources.files("aieng.quantizer").joinpath(CALIBRATION_FILE)))


def calibration_ids(
    folder: Path, text_file: Path, num_samples: int, seq_len: int, eos_id: int | None
) -> torch.Tensor:
    """-> (n, seq_len) int64: the text's documents (blocks separated by a blank line) tokenized
    with the checkpoint's tokenizer.json (its special-token template, e.g. a BOS, applied),
    each followed by the EOS token, concatenated; n = min(num_samples, what the text holds)
    windows spread evenly over it."""
    import re

    from tokenizers import Tokenizer

    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise QuantizeError(
            f"{folder} has no tokenizer.json, needed to tokenize the calibration text "
            "(or use --method rtn)"
        )
    if not text_file.is_file():
        raise QuantizeError(f"calibration file not found: {text_file}")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QuantizeError(f"calibration file {text_file} is not UTF-8 text: {e}") from None
    docs = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    if not docs:
        raise QuantizeError(f"calibration file {text_file} holds no text")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=True):
        ids.extend(encoding.ids)
        if eos_id is not None:
            ids.append(eos_id)
    available = len(ids) // seq_len
    if available == 0:
        raise QuantizeError(
            f"calibration file {text_file} has {len(ids)} tokens, fewer than one sequence of "
            f"--seq-len {seq_len}"
        )
    count = min(num_samples, available)
    stream = torch.tensor(ids, dtype=torch.int64)
    last = len(ids) - seq_len
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return torch.stack([stream[s : s + seq_len] for s in starts])


# --- the model, layer by layer --------------------------------------------------------------


class _LayerRunner:
    """Runs one decoder layer (or a part of it) over the calibration chunks, as training does:
    dense causal attention, no KV cache."""

    def __init__(self, seq_len: int):
        from aieng.attention.causal import CausalAttention

        self.seq_len = seq_len
        self.backend = CausalAttention()
        self._contexts: dict[int, tuple] = {}

    def context(self, tokens: int):
        """-> (positions, ForwardContext) for `tokens` tokens of whole sequences; the same
        positions tensor each time, so the rotary embedding looks cos/sin up once."""
        from aieng.attention.backend import ForwardContext
        from aieng.attention.causal import DenseBatch

        if tokens not in self._contexts:
            rows = tokens // self.seq_len
            metadata = self.backend.build_metadata(DenseBatch(rows, self.seq_len))
            positions = torch.arange(self.seq_len).repeat(rows)
            self._contexts[tokens] = (
                positions,
                ForwardContext(self.backend, metadata, kv_caches=None),
            )
        return self._contexts[tokens]


def _chunks(x: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    rows = max(1, CHUNK_TOKENS // seq_len)
    return list(x.reshape(-1, seq_len, x.shape[-1]).split(rows))


class _Capture:
    """Forward pre-hooks that keep the inputs of a layer's linears over all chunks."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self.handles = [
            module.register_forward_pre_hook(self._hook(name)) for name, module in modules.items()
        ]

    def _hook(self, name: str):
        def keep(module, args):
            self.inputs[name].append(args[0].detach())

        return keep

    def remove(self) -> dict[str, torch.Tensor]:
        for handle in self.handles:
            handle.remove()
        return {name: torch.cat(parts) for name, parts in self.inputs.items()}


def _mse_over_chunks(
    run: Callable[[torch.Tensor, int], torch.Tensor],
    inputs: torch.Tensor,
    reference: torch.Tensor,
    seq_len: int,
) -> float:
    """Mean squared error of run(chunk) against the reference, chunk by chunk (whole sequences).
    run(chunk, tokens) gets the chunk flattened to (tokens, features)."""
    total, count, start = 0.0, 0, 0
    for chunk in _chunks(inputs, seq_len):
        flat = chunk.reshape(-1, chunk.shape[-1])
        out = run(flat, flat.shape[0])
        ref = reference[start : start + flat.shape[0]]
        total += float((out - ref).pow(2).sum())
        count += ref.numel()
        start += flat.shape[0]
    return total / count


def _run_over_chunks(
    run: Callable[[torch.Tensor, int], torch.Tensor], inputs: torch.Tensor, seq_len: int
) -> torch.Tensor:
    outs = []
    for chunk in _chunks(inputs, seq_len):
        flat = chunk.reshape(-1, chunk.shape[-1])
        outs.append(run(flat, flat.shape[0]))
    return torch.cat(outs)


# --- AWQ ------------------------------------------------------------------------------------


@dataclass
class _ScaleGroup:
    """Linears reading one input, what scores their scale, and where the scale folds."""

    name: str  # "qkv", "o", "gate_up", "down"
    linears: list[Any]  # Linear layers (their weights are registered by their method)
    input_name: str  # which captured input they read
    run: Callable[[torch.Tensor, int], torch.Tensor]  # the scored module, on that input
    fold_into: Callable[[torch.Tensor], None]  # divides the preceding op's output by s


def awq_scale_search(group: _ScaleGroup, x: torch.Tensor, scheme: QuantScheme, seq_len: int):
    """-> (best alpha, best s): s = mean|x|**alpha minimising the scored module's output error
    with the group's weights quantized as Q(W diag(s)) diag(s)^-1."""
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    reference = _run_over_chunks(group.run, x, seq_len)
    originals = [linear.weight.data.clone() for linear in group.linears]
    best = (math.inf, 0.0, torch.ones_like(x_mean))
    try:
        for step in range(ALPHA_GRID):
            alpha = step / ALPHA_GRID
            s = x_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
            for linear, w in zip(group.linears, originals, strict=True):
                linear.weight.data = fake_quantize(w * s, scheme) / s
            error = _mse_over_chunks(group.run, x, reference, seq_len)
            if error < best[0]:
                best = (error, alpha, s)
    finally:
        for linear, w in zip(group.linears, originals, strict=True):
            linear.weight.data = w
    return best[1], best[2]


def _apply_scale(group: _ScaleGroup, s: torch.Tensor) -> None:
    with torch.no_grad():
        group.fold_into(s)
        for linear in group.linears:
            linear.weight.mul_(s)


def awq_clip(
    w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, rows: slice | None = None
) -> torch.Tensor:
    """AWQ's auto_clip: per output row and group, the clipping of max|w| (1, 0.95, ..., 0.55)
    that minimises the group's output error on up to CLIP_TOKENS of the inputs x; -> w
    clamped (only `rows`, when given)."""
    rows = rows or slice(0, w.shape[0])
    columns = w.shape[1]
    width = scheme.group_width(columns)
    tokens = x.reshape(-1, columns).float()
    tokens = tokens[:: max(1, tokens.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS]
    xg = tokens.reshape(tokens.shape[0], columns // width, width)  # (T, G, K)
    result = w.clone()
    target = result[rows]
    for part in target.split(CLIP_ROWS):  # bounds the (rows, T, G) products
        wg = part.float().reshape(part.shape[0], columns // width, width)  # (O, G, K)
        reference = torch.einsum("tgk,ogk->otg", xg, wg)
        max_abs = wg.abs().amax(-1, keepdim=True)  # (O, G, 1)
        best_err = torch.full(max_abs.shape, math.inf)
        best_max = max_abs.clone()
        for step in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
            limit = max_abs * (1 - step / CLIP_GRID)
            clipped = torch.clamp(wg, -limit, limit).reshape(part.shape)
            q = fake_quantize(clipped, scheme).reshape(wg.shape)
            err = (torch.einsum("tgk,ogk->otg", xg, q) - reference).pow(2).mean(1)[..., None]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, limit, best_max)
        part.copy_(torch.clamp(wg, -best_max, best_max).reshape(part.shape))
    return result


# --- the whole model ------------------------------------------------------------------------


def _check_source(folder: Path) -> dict:
    if not folder.is_dir():
        raise QuantizeError(f"model folder not found: {folder}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise QuantizeError(f"{folder} has no config.json: not a Hugging Face checkpoint")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise QuantizeError(f"{config_file}: not valid JSON: {e}") from None
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise QuantizeError(
            f"{folder} is already quantized (config.json has a quantization_config, "
            f"quant_method {method!r}); quantize a float checkpoint"
        )
    return raw


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantizeError(f"--out {out} exists and is not empty")


def _quantized_linears(model: Any) -> dict[str, Any]:
    """Our fused layer name (e.g. model.layers.0.self_attn.qkv_proj) -> the linear layer."""
    return {
        name: module
        for name, module in model.model.layers.named_modules(prefix="model.layers")
        if isinstance(module, Linear)
    }


def largest_group_size(config: Any, candidates: tuple[int, ...] = (128, 64, 32)) -> int:
    """The largest candidate group size that divides every decoder linear's input width (the
    default model's MLP width, 704, takes 64 rather than 128)."""
    widths = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads * config.head_dim,
    )
    fits = [g for g in candidates if all(width % g == 0 for width in widths)]
    if not fits:
        raise QuantizeError(f"no group size in {candidates} divides the input widths {widths}")
    return fits[0]


def _check_group_size(model: Any, linears: dict[str, Any], scheme: QuantScheme) -> None:
    if scheme.group_size is None:
        return
    for name, linear in linears.items():
        columns = linear.input_size
        if columns % scheme.group_size:
            sizes = {module.input_size for module in linears.values()}
            fits = [g for g in (128, 64, 32) if all(n % g == 0 for n in sizes)]
            hint = f"--group-size {fits[0]}" if fits else "a divisor"
            layer = _hf_names(model, name, linear.output_sizes)[0]
            raise QuantizeError(
                f"--group-size {scheme.group_size} does not divide the {columns} input "
                f"features of {layer} (use {hint}, or -1 for one group per row)"
            )


def _hf_names(model: Any, fused_name: str, output_sizes: list[int]) -> list[str]:
    """Our fused layer name -> the checkpoint's layer names of its output blocks, in order."""
    names = checkpoint_layer_names(fused_name, getattr(model, "packed_modules", {}))
    if len(names) != len(output_sizes):
        raise QuantizeError(f"{fused_name}: {len(output_sizes)} output blocks, {len(names)} names")
    return names


def _split_rows(weight: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    qs = weight.q.split(sizes)
    scales = weight.scale.split(sizes)
    zps = weight.zero_point.split(sizes) if weight.zero_point is not None else [None] * len(sizes)
    return [
        QuantizedWeight(q.contiguous(), s.contiguous(), z.contiguous() if z is not None else None)
        for q, s, z in zip(qs, scales, zps, strict=True)
    ]


class _Progress:
    """A bar per decoder layer on stderr: redrawn in place on a terminal, a line each otherwise."""

    def __init__(self, total: int, label: str, stream: TextIO | None):
        self.total, self.label, self.stream = total, label, stream
        self.tty = stream is not None and stream.isatty()
        self.start = time.perf_counter()

    def show(self, done: int, note: str = "") -> None:
        if self.stream is None:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.total - done) if done else 0.0
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] {self.label} layer {done}/{self.total}{note} "
            f"{_clock(elapsed)} elapsed, {_clock(left)} left"
        )
        end = "" if self.tty and done < self.total else "\n"
        print(("\r" if self.tty else "") + line, end=end, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def quantize_checkpoint(
    model: str | Path,
    out: str | Path,
    options: QuantizeOptions | None = None,
    progress: TextIO | None = sys.stderr,
) -> QuantizeResult:
    """Quantize the float checkpoint folder `model` into a compressed-tensors pack-quantized
    checkpoint folder `out` (which must not exist, or be empty). Raises QuantizeError (a
    ValueError) with one line for a bad input."""
    from aieng.config.model_config import ModelConfig
    from aieng.models.loader import load_model

    options = options or QuantizeOptions()
    started = time.perf_counter()
    folder, out = Path(model), Path(out)
    if options.method not in METHODS:
        raise QuantizeError(f"--method {options.method!r} is not supported (awq or rtn)")
    if options.num_samples < 1:
        raise QuantizeError(f"--num-samples must be at least 1, got {options.num_samples}")
    scheme = options.scheme
    _check_source(folder)
    _check_out(out)
    config = ModelConfig.from_pretrained(folder)
    calibrated = options.method == "awq" or options.clip
    if calibrated and (config.post_norms or config.qk_norm_across_heads):
        raise QuantizeError(
            f"--method {options.method}{' --clip' if options.clip else ''}: "
            f"{config.architecture} normalises after attention and the MLP (post-norms), "
            "which the calibrated search does not handle; use --method rtn"
        )
    if calibrated and config.moe_layers:
        raise QuantizeError(
            f"--method {options.method}{' --clip' if options.clip else ''}: "
            f"{config.architecture} has mixture-of-experts layers, which the calibrated search "
            "does not handle (each expert sees only its routed tokens); use --method rtn"
        )
    seq_len = options.seq_len or min(DEFAULT_SEQ_LEN, config.max_position_embeddings)
    if seq_len > config.max_position_embeddings:
        raise QuantizeError(
            f"--seq-len {seq_len} exceeds the model's context of "
            f"{config.max_position_embeddings} tokens"
        )
    # The quantizer computes in float32 (folded scales and searches stay exact); the checkpoint
    # keeps the source dtype for its float tensors and scales.
    from aieng.models.loader import resolve_dtype

    out_dtype = resolve_dtype(config.dtype, str(folder / "config.json"))
    fused: Any = load_model(folder, dtype=torch.float32)[0]
    linears = _quantized_linears(fused)
    _check_group_size(fused, linears, scheme)

    calibrate = options.method == "awq" or options.measure or options.clip
    ids = None
    if calibrate:
        text = Path(options.calib) if options.calib is not None else bundled_calibration_text()
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        ids = calibration_ids(folder, text, options.num_samples, seq_len, eos)

    label = options.method.upper()
    bar = _Progress(len(fused.model.layers), label, progress)
    if progress is not None:
        where = (
            f"; calibration: {ids.shape[0]} sequences of {seq_len} tokens"
            if ids is not None
            else ""
        )
        print(f"quantizing {folder} ({label}, {scheme.describe()}){where}", file=progress)
    quantized: dict[str, QuantizedWeight] = {}
    errors: list[float] = []
    alphas: list[dict[str, float]] = []
    with torch.no_grad():
        hidden = fused.model.embed_tokens(ids.flatten()) if ids is not None else None
        runner = _LayerRunner(seq_len)
        for index, layer in enumerate(fused.model.layers):
            bar.show(index)
            prefix = f"model.layers.{index}"
            outputs = None
            if hidden is not None:
                # AWQ's scales (method awq) and clipping (--clip), in place; the float outputs.
                outputs, chosen = _calibrate_layer(layer, config, hidden, runner, scheme, options)
                alphas.append(chosen)
            written: dict[Any, QuantizedWeight] = {}
            for name, linear in linears.items():
                if not name.startswith(prefix + "."):
                    continue
                weight = quantize_rtn(linear.weight.data, scheme, out_dtype)
                written[linear] = weight
                names = _hf_names(fused, name, linear.output_sizes)
                for hf, part in zip(names, _split_rows(weight, linear.output_sizes), strict=True):
                    quantized[hf] = part
            if hidden is not None and outputs is not None:
                errors.append(_layer_error(layer, hidden, outputs, runner, written))
                hidden = outputs  # the next layer reads this layer's float outputs
        bar.show(len(fused.model.layers), _error_note(errors))
        ignore = IGNORE
        untie = False
        if options.quantize_lm_head:
            # A head tied to the embeddings gets its own quantized copy (the checkpoint is
            # written untied); the embedding lookup keeps reading the float rows.
            untie = config.tie_word_embeddings
            head = fused.model.embed_tokens if untie else fused.lm_head
            quantized["lm_head"] = quantize_rtn(head.weight.data, scheme, out_dtype)
            ignore = []

    tensors = _float_tensors(fused, folder, set(quantized))
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_checkpoint(tmp, folder, tensors, quantized, scheme, ignore, untie_lm_head=untie)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return QuantizeResult(
        out=out,
        method=options.method,
        scheme=scheme,
        layers=len(fused.model.layers),
        linears=len(quantized),
        calibration_sequences=0 if ids is None else ids.shape[0],
        calibration_seq_len=seq_len,
        seconds=time.perf_counter() - started,
        bytes_written=sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        layer_errors=errors,
        alphas=alphas,
    )


def _error_note(errors: list[float]) -> str:
    return f", mean layer output MSE {sum(errors) / len(errors):.3g}" if errors else ""


def _calibrate_layer(
    layer: Any,
    config,
    hidden: torch.Tensor,
    runner: _LayerRunner,
    scheme: QuantScheme,
    options: QuantizeOptions,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AWQ's scale search and folding (method awq) and clipping (clip) on one decoder layer, in
    place. -> (the layer's float outputs on `hidden`, the alphas chosen per group)."""
    seq_len = runner.seq_len
    attn, mlp = layer.self_attn, layer.mlp

    def run_layer(x: torch.Tensor, tokens: int) -> torch.Tensor:
        positions, ctx = runner.context(tokens)
        return layer(positions, x, ctx)

    def run_attention(x: torch.Tensor, tokens: int) -> torch.Tensor:
        positions, ctx = runner.context(tokens)
        return attn(positions, x, ctx)

    # Float outputs (the next layer's inputs) and the inputs of every linear.
    capture = _Capture(
        {
            "qkv": attn.qkv_proj,
            "o": attn.o_proj,
            "gate_up": mlp.gate_up_proj,
            "down": mlp.down_proj,
        }
    )
    try:
        outputs = _run_over_chunks(run_layer, hidden, seq_len)
    finally:
        inputs = capture.remove()

    q_size, kv_size, _ = attn.qkv_proj.output_sizes
    v_rows = slice(q_size + kv_size, q_size + 2 * kv_size)
    size = mlp.down_proj.input_size
    up_rows = slice(size, 2 * size)

    def fold_into_norm(norm: Any) -> Callable[[torch.Tensor], None]:
        def fold(s: torch.Tensor) -> None:
            norm.weight.div_(s.to(norm.weight.dtype))

        return fold

    def fold_into_rows(linear: Any, rows: slice) -> Callable[[torch.Tensor], None]:
        def fold(s: torch.Tensor) -> None:
            linear.weight[rows].div_(s[:, None])
            if getattr(linear, "bias", None) is not None:
                linear.bias[rows].div_(s)

        return fold

    groups = [
        _ScaleGroup(
            "qkv", [attn.qkv_proj], "qkv", run_attention, fold_into_norm(layer.input_layernorm)
        )
    ]
    # v -> o: v_proj's output channel j is o_proj's input channel j only without grouped-query
    # attention (with it, one v channel feeds several o columns and s cannot fold per column).
    if config.num_key_value_heads == config.num_attention_heads:
        groups.append(
            _ScaleGroup(
                "o",
                [attn.o_proj],
                "o",
                lambda x, tokens: attn.o_proj(x),
                fold_into_rows(attn.qkv_proj, v_rows),
            )
        )
    groups.append(
        _ScaleGroup(
            "gate_up",
            [mlp.gate_up_proj],
            "gate_up",
            lambda x, tokens: mlp(x),
            fold_into_norm(layer.post_attention_layernorm),
        )
    )
    groups.append(
        _ScaleGroup(
            "down",
            [mlp.down_proj],
            "down",
            lambda x, tokens: mlp.down_proj(x),
            fold_into_rows(mlp.gate_up_proj, up_rows),
        )
    )

    chosen: dict[str, float] = {}
    if options.method == "awq":
        for group in groups:
            x = inputs[group.input_name]
            alpha, s = awq_scale_search(group, x, scheme, seq_len)
            chosen[group.name] = alpha
            _apply_scale(group, s)
            inputs[group.input_name] = x / s  # what the scaled linear now reads
    if options.clip:
        for name, linear, rows in (
            ("qkv", attn.qkv_proj, v_rows),  # v only: q/k errors are amplified by softmax
            ("o", attn.o_proj, None),
            ("gate_up", mlp.gate_up_proj, None),
            ("down", mlp.down_proj, None),
        ):
            linear.weight.data = awq_clip(linear.weight.data, inputs[name], scheme, rows)

    return outputs, chosen


def _layer_error(
    layer: Any,
    hidden: torch.Tensor,
    outputs: torch.Tensor,
    runner: _LayerRunner,
    written: dict[Any, QuantizedWeight],
) -> float:
    """Mean squared error of the layer's output on its float inputs `hidden` with the weights
    as written (dequantized) against its float `outputs`."""

    def run_layer(x: torch.Tensor, tokens: int) -> torch.Tensor:
        positions, ctx = runner.context(tokens)
        return layer(positions, x, ctx)

    originals = {}
    try:
        for linear, weight in written.items():
            originals[linear] = linear.weight.data
            linear.weight.data = weight.dequantize().float()
        return _mse_over_chunks(run_layer, hidden, outputs, runner.seq_len)
    finally:
        for linear, w in originals.items():
            linear.weight.data = w


def _float_tensors(model: Any, folder: Path, quantized_layers: set[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors other than the quantized weights, each in its own dtype: the
    model's current value where it has one (norms and biases AWQ folded scales into), else the
    stored tensor (e.g. a tied checkpoint's lm_head.weight, rotary_emb.inv_freq)."""
    from safetensors import safe_open

    from aieng.models.loader import checkpoint_files

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tensors: dict[str, torch.Tensor] = {}
    for file, names in checkpoint_files(folder).items():
        with safe_open(file, framework="pt") as handle:
            for name in names if names is not None else list(handle.keys()):
                layer, _, suffix = name.rpartition(".")
                if suffix == "weight" and layer in quantized_layers:
                    continue
                stored = handle.get_tensor(name)
                value = _model_value(name, params, packed, model)
                if value is not None and tuple(value.shape) == tuple(stored.shape):
                    stored = value.to(stored.dtype)
                tensors[name] = stored.contiguous()
    return tensors


def _model_value(name: str, params: dict, packed: dict, model: Any) -> torch.Tensor | None:
    """The model's value of checkpoint tensor `name` (its block of a fused parameter)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
            param = params.get(target)
            if param is None:
                return None
            layer = model.get_submodule(".".join(parts[:i]) + "." + fused)
            sizes = layer.output_sizes
            return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
    param = params.get(name)
    return None if param is None else param.data
