"""`aieng quantize`: a float checkpoint -> an INT4/INT8 compressed-tensors checkpoint (AWQ, RTN)."""

from __future__ import annotations

import argparse
import sys

from aieng.cli.common import positive_int


def group_size(text: str) -> int:
    if text.strip().lower() == "channel":
        return -1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r} (a number of input columns, or -1 / channel)"
        ) from None


def add_quantize(commands) -> None:
    from aieng.quantizer.defaults import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN

    p = commands.add_parser(
        "quantize",
        help="quantize a model's weights to INT4/INT8 (AWQ or RTN)",
        description="Quantize the linear layers of a float Hugging Face checkpoint (Llama, "
        "Mistral, Qwen2, Qwen3) to 4- or 8-bit integers with a scale (and zero point) per group "
        "of input columns, and write a compressed-tensors `pack-quantized` checkpoint (the "
        "format llm-compressor writes; aieng, vLLM and transformers with the compressed-tensors "
        "package load it) with the tokenizer files. AWQ scales each input channel by its mean "
        "activation on calibration text before quantizing, choosing the exponent that "
        "minimises each block's output error; RTN rounds the weights to nearest. Embeddings "
        "and the LM head stay float.",
        epilog="example: aieng quantize path/to/model --out model-awq-int4 --group-size 64",
    )
    p.add_argument(
        "model", metavar="MODEL", nargs="?",
        help="a float checkpoint folder (default: the bundled default model)",
    )  # fmt: skip
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty)")
    p.add_argument(
        "--method", choices=("awq", "rtn"), default="awq",
        help="awq (activation-aware scales, calibrated) or rtn (round to nearest, no "
        "calibration) (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--bits", type=int, default=4, metavar="B", help="4 or 8 (default: 4)")
    p.add_argument(
        "--group-size", type=group_size, default=128, metavar="G",
        help="input columns per scale; -1 or 'channel': one scale per output row "
        "(default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--symmetric", action="store_true",
        help="no zero point: scale = max|w| / 7.5 (4-bit) (default: asymmetric, a zero point "
        "per group)",
    )  # fmt: skip
    p.add_argument(
        "--quantize-lm-head", action="store_true",
        help="quantize the LM head too (round to nearest); by default it stays float. A head "
        "tied to the embeddings gets its own quantized copy (the checkpoint is written untied; "
        "the embedding lookup keeps the float rows)",
    )  # fmt: skip
    calib = p.add_argument_group("calibration (awq, --clip)")
    calib.add_argument(
        "--calib", metavar="FILE",
        help="UTF-8 calibration text, documents separated by blank lines (default: the bundled "
        "293 KB of King James Bible chapters); with --method rtn, it also measures each "
        "layer's output error",
    )  # fmt: skip
    calib.add_argument(
        "--num-samples", type=positive_int, default=DEFAULT_NUM_SAMPLES, metavar="N",
        help="calibration sequences (default: %(default)s; fewer if the text is shorter)",
    )  # fmt: skip
    calib.add_argument(
        "--seq-len", type=positive_int, metavar="N",
        help=f"tokens per calibration sequence (default: {DEFAULT_SEQ_LEN}, at most the "
        "model's context)",
    )  # fmt: skip
    calib.add_argument(
        "--clip", action="store_true",
        help="also search a clipping of each group's max|w| minimising its output error "
        "(AWQ's auto_clip)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=positive_int, metavar="N",
        help="torch threads (default: all cores; on a machine busy with other work, 1 can be "
        "several times faster)",
    )  # fmt: skip
    p.set_defaults(run=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from aieng.config.default_model import resolve_model
    from aieng.quantizer.compressed_tensors_writer import QuantScheme
    from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    scheme = QuantScheme(
        bits=args.bits,
        group_size=None if args.group_size == -1 else args.group_size,
        symmetric=args.symmetric,
    )
    options = QuantizeOptions(
        method=args.method,
        scheme=scheme,
        calib=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        clip=args.clip,
        quantize_lm_head=args.quantize_lm_head,
        measure=args.calib is not None,
    )
    result = quantize_checkpoint(resolve_model(args.model), args.out, options, sys.stderr)
    errors = ""
    if result.layer_errors:
        worst = max(result.layer_errors)
        mean = sum(result.layer_errors) / len(result.layer_errors)
        errors = f"; layer output MSE on calibration text: mean {mean:.4g}, worst {worst:.4g}"
    print(
        f"wrote {result.out}: {result.linears} linear weights {result.method.upper()} "
        f"{scheme.describe()} in {result.layers} layers, "
        f"{result.bytes_written / 1e6:.1f} MB, {result.seconds:.1f} s{errors}"
    )
    return 0
