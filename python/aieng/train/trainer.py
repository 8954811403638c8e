"""The training loop behind `aieng train`: tokenizer, data, AdamW with warmup and cosine decay,
held-out evaluation, checkpoints that resume exactly, and the Hugging Face folder it exports.

Output folder layout:
  config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
      a Hugging Face checkpoint: with held-out text, the step with the lowest held-out loss so
      far (rewritten whenever an evaluation improves on it); without, the latest checkpoint;
  training_state.pt   model, optimizer, data-sampler state and step, for `--resume`;
  training_log.json   the run's settings, loss history, timings and held-out results.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from aieng.config.model_config import ModelConfig
from aieng.models.llama import LlamaForCausalLM
from aieng.models.loader import load_weights
from aieng.train.bpe import EOS_TOKEN, IM_END, save_tokenizer, train_tokenizer
from aieng.train.causal_lm import batch_logits, batch_loss, new_model, num_parameters
from aieng.train.config import RESUMABLE_OPTIONS, TrainConfig
from aieng.train.contrastive import ContrastiveObjective
from aieng.train.corpus import read_documents
from aieng.train.export import export_checkpoint, write_json, write_pooling_files

STATE_FILE = "training_state.pt"
LOG_FILE = "training_log.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class TrainResult:
    out: Path
    steps: int
    parameters: int
    train_tokens: int
    heldout_tokens: int
    train_seconds: float
    final_loss: float
    heldout_loss: float | None  # of the exported checkpoint
    best_step: int | None  # the step exported (with held-out text)
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def train(
    cfg: TrainConfig,
    resume: bool = False,
    log: TextIO = sys.stderr,
    stop_after: int | None = None,
) -> TrainResult:
    """Runs a training run to `cfg.steps`; with `resume`, continues the one saved in `cfg.out`
    (see `resume`), taking only `cfg`'s RESUMABLE_OPTIONS. `stop_after` ends this run early
    after that step with a checkpoint, as an interruption would; resuming continues as if the
    run had never stopped."""
    if resume:
        overrides = {name: getattr(cfg, name) for name in RESUMABLE_OPTIONS}
        return resume_run(cfg.out, overrides, log, stop_after)
    return _run(cfg, None, log, stop_after)


def resume_run(
    out: str | Path,
    overrides: dict[str, Any] | None = None,
    log: TextIO = sys.stderr,
    stop_after: int | None = None,
) -> TrainResult:
    """Continues the run saved in `out` with its own settings; `overrides` may change only
    RESUMABLE_OPTIONS (the step count and the logging/checkpoint cadence)."""
    state_path = Path(out) / STATE_FILE
    if not state_path.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out}")
    unknown = set(overrides or {}) - set(RESUMABLE_OPTIONS)
    if unknown:
        raise ValueError(f"a resumed run cannot change {sorted(unknown)}")
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    cfg = TrainConfig(**{**state["config"], **(overrides or {}), "out": str(out)})
    return _run(cfg, state, log, stop_after)


def _run(
    cfg: TrainConfig, state: dict[str, Any] | None, log: TextIO, stop_after: int | None
) -> TrainResult:
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    train_docs, held_docs = _documents(cfg)
    tokenizer = _tokenizer(cfg, out, train_docs, reuse=state is not None)
    config_json, generation_config = _model_configs(cfg, tokenizer)
    eos_id = config_json["eos_token_id"]
    train_ids = _encode(tokenizer, train_docs, eos_id)
    held_ids = _encode(tokenizer, held_docs, eos_id) if held_docs else None
    objective: _Objective
    if cfg.objective == "contrastive":
        objective = ContrastiveObjective(cfg, tokenizer, eos_id, train_docs, held_docs)
    else:
        objective = _CausalObjective(cfg, train_ids, held_ids)
    # config.json as exported, and the model built from it: one description of the model
    model = _initial_model(cfg, config_json, fresh=state is None)
    optimizer = _optimizer(model, cfg)
    sampler = torch.Generator().manual_seed(cfg.seed)
    step, elapsed, history = 0, 0.0, []
    best: dict[str, float] | None = None  # {"step", "heldout_loss"} of the exported checkpoint
    if state is not None:
        _load_model_state(model, state["model"], state_path)
        optimizer.load_state_dict(state["optimizer"])
        sampler.set_state(state["sampler"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        best = state.get("best", _last_eval(history))
        print(f"resuming {out} at step {step}/{cfg.steps}", file=log)
    print(
        f"model: {num_parameters(model) / 1e6:.2f}M parameters, "
        f"{config_json['num_hidden_layers']} layers, hidden {config_json['hidden_size']}, "
        f"vocab {config_json['vocab_size']}; {cfg.objective} objective; {objective.describe()}",
        file=log,
    )

    def export() -> None:
        export_checkpoint(out, model, config_json, generation_config, cfg.save_dtype)
        if cfg.objective == "contrastive":
            write_pooling_files(out, config_json["hidden_size"], cfg.pooling, cfg.seq_len)

    def save() -> None:
        if not objective.has_heldout:
            export()
        extra = {"best": best}
        _save_state(state_path, model, optimizer, sampler, step, elapsed, history, cfg, extra)

    progress = _Progress(cfg, objective.units_per_step, objective.unit, log)
    loss_value = float("nan")
    model.train()
    last_step = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    while step < last_step:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = objective.loss(model, sampler)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        elapsed += time.perf_counter() - started
        loss_value = loss.item()
        record: dict[str, float] = {"step": step, "loss": loss_value, "elapsed": elapsed}
        if objective.has_heldout and (step % cfg.eval_interval == 0 or step == cfg.steps):
            record["heldout_loss"] = objective.heldout_loss(model)
            if best is None or record["heldout_loss"] < best["heldout_loss"]:
                best = {"step": step, "heldout_loss": record["heldout_loss"]}
                export()
        if step % cfg.log_interval == 0 or "heldout_loss" in record or step == cfg.steps:
            history.append(record)
            progress.show(step, record, lr_at(step - 1, cfg))
        if step % cfg.checkpoint_interval == 0 or step == last_step:
            save()
    progress.done()
    result = TrainResult(
        out=out,
        steps=step,
        parameters=num_parameters(model),
        train_tokens=len(train_ids),
        heldout_tokens=0 if held_ids is None else len(held_ids),
        train_seconds=elapsed,
        final_loss=loss_value,
        heldout_loss=None if best is None else best["heldout_loss"],
        best_step=None if best is None else int(best["step"]),
        history=history,
    )
    _write_log(out, cfg, result)
    return result


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over (N, seq_len + 1) held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = batch_logits(model, chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        )
        total, count = total + loss.item(), count + chunk[:, 1:].numel()
    model.train()
    return total / count


# ---------------------------------------------------------------------------------- pieces


class _Objective(Protocol):
    """What the loop trains: a loss per step, and a held-out loss when there is held-out data."""

    unit: str  # what units_per_step counts, for the progress line
    units_per_step: int

    @property
    def has_heldout(self) -> bool: ...

    def describe(self) -> str: ...

    def loss(self, model: LlamaForCausalLM, sampler: torch.Generator) -> torch.Tensor: ...

    def heldout_loss(self, model: LlamaForCausalLM) -> float: ...


class _CausalObjective:
    """Next-token prediction over random windows of the training text."""

    unit = "tok"

    def __init__(self, cfg: TrainConfig, train_ids: torch.Tensor, held_ids: torch.Tensor | None):
        if len(train_ids) <= cfg.seq_len + 1:
            raise ValueError(
                f"the training text has {len(train_ids)} tokens; --seq-len {cfg.seq_len} needs more"
            )
        self.cfg, self.train_ids, self.held_ids = cfg, train_ids, held_ids
        self.units_per_step = cfg.batch_size * cfg.seq_len
        self.windows = _eval_windows(held_ids, cfg) if held_ids is not None else None

    @property
    def has_heldout(self) -> bool:
        return self.windows is not None

    def describe(self) -> str:
        held = "" if self.held_ids is None else f", {len(self.held_ids):,} held-out"
        return f"{len(self.train_ids):,} training tokens{held}"

    def loss(self, model: LlamaForCausalLM, sampler: torch.Generator) -> torch.Tensor:
        inputs, targets = _batch(self.train_ids, self.cfg, sampler)
        return batch_loss(model, inputs, targets)

    def heldout_loss(self, model: LlamaForCausalLM) -> float:
        assert self.windows is not None
        return evaluate(model, self.windows, self.cfg.batch_size)


def _documents(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    docs = read_documents(cfg.data)
    if cfg.heldout:
        return docs, read_documents(cfg.heldout)
    n_held = int(len(docs) * cfg.heldout_fraction)
    if n_held == 0:
        return docs, []
    return docs[:-n_held], docs[-n_held:]


def _tokenizer(cfg: TrainConfig, out: Path, docs: list[str], reuse: bool):
    """The one of --init-from (its files copied to `out`), the --tokenizer file, or a new BPE
    tokenizer trained on `docs`."""
    from tokenizers import Tokenizer

    path = out / "tokenizer.json"
    if reuse:
        return Tokenizer.from_file(str(path))
    if cfg.init_from:
        source = Path(cfg.init_from)
        if not (source / "tokenizer.json").is_file():
            raise ValueError(f"--init-from {source}: no tokenizer.json")
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        return Tokenizer.from_file(str(path))
    if cfg.tokenizer is not None:  # a given tokenizer (a draft shares its target's)
        tokenizer = Tokenizer.from_file(cfg.tokenizer)
    else:
        tokenizer = train_tokenizer(docs, cfg.vocab_size)
    save_tokenizer(tokenizer, out, cfg.seq_len)
    return tokenizer


def _encode(tokenizer, docs: list[str], eos_id: int) -> torch.Tensor:
    """Documents' ids, each followed by the end-of-text token, as one int64 stream."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def _optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; norms (1-D weights) get no weight decay."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _batch(
    ids: torch.Tensor, cfg: TrainConfig, sampler: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=sampler)
    rows = torch.stack([ids[s : s + cfg.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def _eval_windows(ids: torch.Tensor, cfg: TrainConfig) -> torch.Tensor | None:
    """Up to `eval_windows` non-overlapping windows spread evenly over the held-out text."""
    span = cfg.seq_len + 1
    available = len(ids) // span
    if available == 0:
        return None
    picks = torch.linspace(0, available - 1, min(cfg.eval_windows, available)).long().unique()
    return torch.stack([ids[i * span : (i + 1) * span] for i in picks.tolist()])


def _model_configs(cfg: TrainConfig, tokenizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (config.json, generation_config.json) of the model: a fresh one of the run's shape,
    or the --init-from checkpoint's (a Llama)."""
    if not cfg.init_from:
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        shape = cfg.shape(tokenizer.get_vocab_size())
        return shape.hf_config(eos_id, eos_id), _generation_config(tokenizer, eos_id)
    source = Path(cfg.init_from)
    config = _read_json(source / "config.json")
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(
            f"--init-from {source}: a LlamaForCausalLM checkpoint is needed, this one is "
            f"{config.get('architectures')}"
        )
    eos = config.get("eos_token_id")
    eos_id = eos[0] if isinstance(eos, list) else eos
    if not isinstance(eos_id, int):
        raise ValueError(f"--init-from {source}: config.json has no eos_token_id")
    generation = source / "generation_config.json"
    return (
        {**config, "eos_token_id": eos_id},
        _read_json(generation) if generation.is_file() else {"eos_token_id": eos_id},
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _initial_model(cfg: TrainConfig, config_json: dict[str, Any], fresh: bool) -> LlamaForCausalLM:
    """The float32 model of `config_json`: fresh weights, or --init-from's (when `fresh`; a
    resumed run loads its own state instead)."""
    config = ModelConfig.from_dicts(config_json)
    if not cfg.init_from:
        return new_model(config, config_json["initializer_range"])
    model = LlamaForCausalLM(config, torch.float32)
    if fresh:
        load_weights(model, Path(cfg.init_from))
    return model


def _generation_config(tokenizer, eos_id: int) -> dict[str, Any]:
    return {
        "bos_token_id": eos_id,
        "eos_token_id": [eos_id, tokenizer.token_to_id(IM_END)],
        "pad_token_id": eos_id,
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
    }


def _load_model_state(model: LlamaForCausalLM, saved: dict[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(saved)
    except RuntimeError as e:
        raise ValueError(f"{path}: its model state does not fit this model ({e})") from e


def _last_eval(history: list[dict[str, float]]) -> dict[str, float] | None:
    """For a state saved before `best` was recorded: the last evaluation, which is what the
    exported folder held when eval and checkpoint intervals coincide."""
    evals = [h for h in history if "heldout_loss" in h]
    return {"step": evals[-1]["step"], "heldout_loss": evals[-1]["heldout_loss"]} if evals else None


def _save_state(path: Path, model, optimizer, sampler, step, elapsed, history, cfg, extra) -> None:
    state = {
        **extra,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.get_state(),
        "step": step,
        "elapsed": elapsed,
        "history": history,
        "config": asdict(cfg),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _write_log(out: Path, cfg: TrainConfig, result: TrainResult) -> None:
    summary = {k: v for k, v in asdict(result).items() if k not in ("out", "history")}
    write_json(out / LOG_FILE, {"config": asdict(cfg), **summary, "history": result.history})


class _Progress:
    """One line per log interval: a bar, loss, held-out loss, tokens (or pairs)/s and time
    left."""

    def __init__(self, cfg: TrainConfig, units_per_step: int, unit: str, stream: TextIO):
        self.cfg, self.stream = cfg, stream
        self.units_per_step, self.unit = units_per_step, unit
        self.tty = stream.isatty()
        self.last: tuple[float, float] | None = None  # (step, elapsed) of the last line

    def show(self, step: int, record: dict[str, float], lr: float) -> None:
        elapsed = record["elapsed"]
        if self.last is not None and elapsed > self.last[1]:
            rate = (step - self.last[0]) / (elapsed - self.last[1])
        else:
            rate = step / max(elapsed, 1e-9)
        self.last = (step, elapsed)
        units_per_s = rate * self.units_per_step
        left = (self.cfg.steps - step) / max(rate, 1e-9)
        width = 24
        filled = int(width * step / self.cfg.steps)
        bar = "#" * filled + "." * (width - filled)
        held = f" heldout {record['heldout_loss']:.3f}" if "heldout_loss" in record else ""
        line = (
            f"[{bar}] {step}/{self.cfg.steps} loss {record['loss']:.3f}{held} lr {lr:.2e} "
            f"{units_per_s:,.{0 if units_per_s >= 10 else 2}f} {self.unit}/s {_clock(elapsed)} "
            f"elapsed, {_clock(left)} left"
        )
        if self.tty and not held:
            print("\r" + line, end="", file=self.stream, flush=True)
        else:
            print(("\r" if self.tty else "") + line, file=self.stream, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=self.stream)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
