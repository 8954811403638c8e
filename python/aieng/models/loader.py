"""Load a Hugging Face checkpoint folder into a model.

Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`, memory-mapped
through safetensors' `safe_open` (never `torch.load`, which can run arbitrary code). Each tensor
goes to its parameter's `weight_loader`, which places it (a shard of a fused q/k/v or gate/up
along the dimension its linear method says) and converts its dtype where the method allows.
Every problem raises a ValueError naming the file and the tensor.
"""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from aieng.config.engine_args import checkpoint_dtype, torch_dtype
from aieng.config.model_config import ModelConfig
from aieng.layers.cpu_lm_head import prepare_cpu_lm_head
from aieng.layers.linear import (
    LinearMethodChooser,
    WeightLoadError,
    default_weight_loader,
)
from aieng.models.registry import model_class
from aieng.quantization.methods import (
    describe_linear_kernels,
    process_weights_after_loading,
    quantized_linear_methods,
)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, stored by some old checkpoints


@dataclass
class LoadTimes:
    """Where a model's load went. The runner adds the KV cache's allocation and logs the sum."""

    reading_s: float = 0.0  # safetensors reads (memory-mapped: the page-ins)
    placing_s: float = 0.0  # the weight loaders: dtype conversion, checks, copy to the device
    repacking_s: float = 0.0  # process_weights_after_loading: quantized layers' compute layout
    building_s: float = 0.0  # constructing the (uninitialised) model on the device
    kv_cache_s: float = 0.0  # the runner: sizing (a profiling forward on a GPU) and allocation

    @property
    def total_s(self) -> float:
        return sum(self.phases().values())

    def phases(self) -> dict[str, float]:
        return {
            "build": self.building_s,
            "read": self.reading_s,
            "place": self.placing_s,
            "repack": self.repacking_s,
            "kv_cache": self.kv_cache_s,
        }

    def describe(self) -> str:
        return (
            f"model loaded in {self.total_s:.2f} s (build {self.building_s:.2f} s, read "
            f"{self.reading_s:.2f} s, convert and place {self.placing_s:.2f} s, repack "
            f"{self.repacking_s:.2f} s, KV cache {self.kv_cache_s:.2f} s)"
        )


def resolve_dtype(name: str, source: str = "config.json") -> torch.dtype:
    return torch_dtype(checkpoint_dtype(name, source))


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
    linear_methods: LinearMethodChooser | None = None,
    times: LoadTimes | None = None,
    cpu_quant_kernel: str = "auto",
    cpu_lm_head: str = "dense",
) -> tuple[nn.Module, ModelConfig]:
    """-> (model in eval mode on `device`, its config). dtype defaults to the checkpoint's.
    linear_methods defaults to what the checkpoint's `quantization_config` calls for. `times`,
    if given, receives where the load went. `cpu_quant_kernel`, `cpu_lm_head`: the EngineArgs
    options."""
    folder = Path(path)
    config = config or ModelConfig.from_pretrained(folder)
    cls = model_class(config.architecture, str(folder / "config.json"))
    dtype = dtype or resolve_dtype(config.dtype, str(folder / "config.json"))
    if linear_methods is None:
        packed = getattr(cls, "packed_modules", {})
        linear_methods = quantized_linear_methods(
            config.quantization, packed, device=device, cpu_kernel=cpu_quant_kernel
        )
    times = times if times is not None else LoadTimes()
    start = time.perf_counter()
    with torch.device(device):
        model = cls(config, dtype, linear_methods)
    times.building_s += time.perf_counter() - start
    load_weights(model, folder, times)
    start = time.perf_counter()
    process_weights_after_loading(model)
    head = prepare_cpu_lm_head(model, cpu_lm_head)
    times.repacking_s += time.perf_counter() - start
    quantized = f"; LM head: {head}"
    if config.quantization is not None:
        quantized += f"; {config.quantization.describe()}: {describe_linear_kernels(model)}"
    logger.info(
        "loaded %s from %s: build %.2fs, read %.2fs, convert and place %.2fs, repack %.2fs%s",
        config.architecture,
        folder,
        times.building_s,
        times.reading_s,
        times.placing_s,
        times.repacking_s,
        quantized,
    )
    return model.eval(), config


def checkpoint_files(folder: Path) -> dict[Path, list[str] | None]:
    """-> {file: tensor names the index assigns to it (None: all tensors of a single file)}."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: cannot read the weight_map: {e}") from e
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            shard = folder / file
            if not shard.is_file():
                raise ValueError(f"{index}: tensor {name} is in {file}, which does not exist")
            files.setdefault(shard, []).append(name)
        return dict(files)
    single = folder / SINGLE_FILE
    if single.is_file():
        return {single: None}
    raise ValueError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors are loaded)")


def load_weights(model: nn.Module, folder: Path, times: LoadTimes | None = None) -> LoadTimes:
    """Every checkpoint tensor goes to its parameter's `weight_loader` (with its shard of a fused
    layer); the loop itself knows nothing of fusing, packing or dtypes."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    # A family's own naming (None: a tensor it does not use), e.g. BERT's `bert.` prefix.
    rename = getattr(model, "checkpoint_name", None)
    filled: dict[str, set[int | None]] = {name: set() for name in params}
    times = times if times is not None else LoadTimes()
    files = checkpoint_files(folder)
    for file, names in files.items():
        try:
            with safe_open(file, framework="pt") as handle:
                stored = set(handle.keys())
                for name in names if names is not None else sorted(stored):
                    if name not in stored:
                        raise ValueError(
                            f"{file}: tensor {name} is listed in {INDEX_FILE} but absent"
                        )
                    if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    ours = rename(name) if rename is not None else name
                    if ours is None:
                        continue
                    target, shard = _target(ours, packed)
                    if target not in params:
                        raise ValueError(f"{file}: unexpected tensor {name}")
                    param = params[target]
                    start = time.perf_counter()
                    tensor = handle.get_tensor(name)
                    read_at = time.perf_counter()
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    try:
                        loader(param, tensor, shard)
                    except WeightLoadError as e:
                        raise ValueError(f"{file}: tensor {name} {e}") from None
                    times.reading_s += read_at - start
                    times.placing_s += time.perf_counter() - read_at
                    if shard is None:  # the whole (possibly fused) parameter
                        filled[target].update(range(_num_shards(param)))
                    else:
                        filled[target].add(shard)
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read safetensors file: {e}") from e
    missing = [
        name
        for target, shards in filled.items()
        if len(shards) < _num_shards(params[target])
        for name in _source_names(target, packed, _num_shards(params[target]), shards)
    ]
    if missing:
        where = ", ".join(str(file) for file in files)
        raise ValueError(f"{where}: missing tensor {', '.join(missing)}")
    return times


def _target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, shard index within a fused layer; None: the whole
    parameter — also a fused one the checkpoint stores fused)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return name, None


def _num_shards(param: nn.Parameter) -> int:
    return getattr(param, "num_shards", 1)


def _source_names(
    target: str, packed: dict[str, tuple[str, int]], expected: int, shards: set[int | None]
) -> list[str]:
    if expected == 1:
        return [target]
    prefix, fused_name, suffix = _split_fused(target, packed)
    return [
        f"{prefix}{original}.{suffix}"
        for original, (fused, shard) in packed.items()
        if fused == fused_name and shard not in shards
    ]


def _split_fused(target: str, packed: dict[str, tuple[str, int]]) -> tuple[str, str, str]:
    fused_names = {fused for fused, _ in packed.values()}
    parts = target.split(".")
    i = next(i for i, part in enumerate(parts) if part in fused_names)
    prefix = ".".join(parts[:i])
    return (prefix + "." if prefix else ""), parts[i], ".".join(parts[i + 1 :])
