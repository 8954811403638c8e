"""`aieng train`: a Llama-architecture model trained from scratch on a text corpus."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aieng.cli.common import positive_int


def add_train(commands) -> None:
    from aieng.train.config import CONTRASTIVE_POOLING, OBJECTIVES, TrainConfig

    d = TrainConfig(data="", out="")
    p = commands.add_parser(
        "train",
        help="train a small Llama (a language model, or a bi-encoder) on a text corpus",
        description="Train a byte-level BPE tokenizer and a Llama-architecture causal LM from "
        "scratch on a plain-text corpus (documents separated by blank lines), writing a Hugging "
        "Face folder that transformers and aieng load: with held-out text, the checkpoint with "
        "the lowest held-out loss (evaluated every --eval-interval steps), else the latest. "
        "The full training state is saved every --checkpoint-interval steps; --resume "
        "continues a run exactly where it stopped.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="FILE", help="training text file")
    source.add_argument(
        "--kjv",
        action="store_true",
        help="the King James Bible from Debian's bible-kjv package, with the books "
        "Ruth, Ecclesiastes, Jonah, Mark and Philippians held out",
    )
    source.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    p.add_argument("--out", metavar="DIR", help="output folder (required unless --resume)")
    p.add_argument("--heldout", metavar="FILE", help="held-out text file for evaluation")
    p.add_argument(
        "--heldout-fraction", type=float, metavar="F",
        help="without --heldout: the last F of the documents (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", metavar="FILE",
        help="reuse this tokenizer.json instead of training one (a draft model shares its "
        "target's tokenizer; --vocab-size is then the file's)",
    )  # fmt: skip
    p.add_argument(
        "--init-from", metavar="DIR",
        help="start from this Llama checkpoint (its shape, tokenizer and weights; the model "
        "size options are then ignored); 'default': the bundled default model",
    )  # fmt: skip
    objective = p.add_argument_group(
        "objective",
        "causal: next-token prediction (a language model). contrastive: a bi-encoder for "
        "embeddings, in-batch negatives InfoNCE on (query, passage) pairs built from the "
        "corpus: a verse with words dropped as the query, the window of --pair-window lines "
        "holding it as the passage, another window of its chapter as a hard negative; the "
        "folder gets sentence-transformers' pooling files, so LLM.embed pools as trained.",
    )
    objective.add_argument(
        "--objective", choices=OBJECTIVES, help=f"training objective ({d.objective})"
    )
    objective.add_argument(
        "--pooling", choices=CONTRASTIVE_POOLING, help=f"contrastive pooling ({d.pooling})"
    )
    objective.add_argument(
        "--temperature", type=float, help=f"contrastive softmax temperature ({d.temperature})"
    )
    _int_option(objective, "pair_window", d.pair_window, "lines in a contrastive passage")
    objective.add_argument(
        "--query-drop", type=float,
        help=f"probability of dropping each word of a contrastive query ({d.query_drop})",
    )  # fmt: skip
    objective.add_argument(
        "--no-hard-negatives", dest="hard_negatives", action="store_false", default=None,
        help="contrastive: in-batch negatives only, no same-chapter hard negative",
    )  # fmt: skip
    size = p.add_argument_group("model size")
    for name, help_text in (
        ("vocab_size", "BPE vocabulary size"),
        ("hidden_size", "hidden size"),
        ("num_layers", "decoder layers"),
        ("num_heads", "attention heads"),
        ("num_kv_heads", "key/value heads (grouped-query attention when fewer)"),
        ("intermediate_size", "MLP size"),
        ("seq_len", "training sequence length (also the model's context)"),
    ):
        _int_option(size, name, getattr(d, name), help_text)
    run = p.add_argument_group("optimization")
    _int_option(run, "steps", d.steps, "optimizer steps (with --resume: the new total)")
    _int_option(run, "batch_size", d.batch_size, "sequences per step")
    run.add_argument("--lr", type=float, help=f"peak learning rate ({d.lr})")
    run.add_argument(
        "--min-lr-ratio", type=float, help=f"cosine decay ends at lr * this ({d.min_lr_ratio})",
    )  # fmt: skip
    _int_option(run, "warmup_steps", d.warmup_steps, "linear warmup steps")
    run.add_argument("--weight-decay", type=float, help=f"AdamW weight decay ({d.weight_decay})")
    run.add_argument("--grad-clip", type=float, help=f"gradient norm clip ({d.grad_clip})")
    run.add_argument("--seed", type=int, help=f"seed of weights and data order ({d.seed})")
    cadence = p.add_argument_group("logging and checkpoints")
    _int_option(cadence, "eval_interval", d.eval_interval, "steps between held-out evals")
    _int_option(cadence, "eval_windows", d.eval_windows, "held-out windows per eval")
    _int_option(cadence, "checkpoint_interval", d.checkpoint_interval, "steps between saves")
    _int_option(cadence, "log_interval", d.log_interval, "steps between progress lines")
    cadence.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    cadence.add_argument(
        "--save-dtype", choices=("float32", "bfloat16"),
        help=f"dtype of model.safetensors ({d.save_dtype})",
    )  # fmt: skip
    p.set_defaults(run=run_train)


def _int_option(group, name: str, default: int, help_text: str) -> None:
    # The parser's default stays None so that --resume can tell an option given from one not.
    group.add_argument(
        "--" + name.replace("_", "-"),
        type=positive_int,
        metavar="N",
        help=f"{help_text} (default: {default})",
    )


def config_from_args(args: argparse.Namespace, data: str, heldout: str | None):
    from aieng.train.config import TrainConfig

    defaults = TrainConfig(data=data, out=args.out, heldout=heldout)
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in ("data", "out", "heldout") and getattr(args, f.name, None) is not None
    }
    if given.get("init_from") == "default":
        from aieng.config.default_model import default_model_path

        given["init_from"] = str(default_model_path())
    return dataclasses.replace(defaults, **given)


def resume_overrides(args: argparse.Namespace) -> dict:
    """The options --resume may change, where given; the rest come from the saved run."""
    from aieng.train.config import RESUMABLE_OPTIONS

    return {n: getattr(args, n) for n in RESUMABLE_OPTIONS if getattr(args, n) is not None}


def run_train(args: argparse.Namespace) -> int:
    from aieng.train.trainer import resume_run, train

    if args.resume:
        result = resume_run(args.resume, resume_overrides(args))
    else:
        if not args.out:
            raise ValueError("--out DIR is required (the folder the model is written to)")
        if args.kjv:
            from aieng.train.corpus import write_kjv

            data, heldout = (str(p) for p in write_kjv(Path(args.out) / "corpus"))
        else:
            data, heldout = args.data, args.heldout
        result = train(config_from_args(args, data, heldout))
    held = (
        f"; exported step {result.best_step}, the best held-out loss {result.heldout_loss:.4f}"
        if result.heldout_loss is not None
        else ""
    )
    print(
        f"trained {result.parameters / 1e6:.2f}M parameters for {result.steps} steps in "
        f"{result.train_seconds / 60:.1f} min: final loss {result.final_loss:.4f}{held}; "
        f"wrote {result.out}"
    )
    return 0
