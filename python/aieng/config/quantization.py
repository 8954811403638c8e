"""Reading a checkpoint's `quantization_config` (config.json) into per-layer weight schemes.

Three checkpoint formats of weight-only integer quantization load:
- compressed-tensors `pack-quantized` (what llm-compressor writes): 4- or 8-bit, group or channel
  strategy, symmetric or asymmetric, several config groups each targeting layers by class
  (`Linear`), exact name or `re:` regular expression, and an `ignore` list;
- AutoAWQ `gemm` (`quant_method: "awq"`): 4-bit, asymmetric, group-wise;
- GPTQ (`quant_method: "gptq"`, AutoGPTQ / GPTQModel `gptq` and `gptq_v2` checkpoint formats):
  4- or 8-bit, `desc_act: false` only.
Everything else is refused by name, before any weight is read. Which layers are quantized is
decided on the checkpoint's own layer names; a fused layer (q/k/v, gate/up) must be quantized
the same way in all its parts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED = "compressed-tensors W4A16/W8A16 pack-quantized, awq, gptq"
GROUP_SIZES = (32, 64, 128)


class QuantizationConfigError(ValueError):
    """A `quantization_config` aieng cannot load; the message names the field and value."""


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is quantized and stored."""

    format: str  # "compressed-tensors", "awq" or "gptq"
    bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    zero_point_offset: int = 0  # GPTQ v1 stores zero - 1: add this to the stored zeros

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "channel"
        kind = "sym" if self.symmetric else "asym"
        return f"int{self.bits} {group} {kind}"


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "compressed-tensors", "awq", "gptq"
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), in order
    ignore: tuple[str, ...] = ()
    substring_ignore: bool = False  # AWQ's modules_to_not_convert match by substring

    def scheme_for(self, names: list[str]) -> WeightScheme | None:
        """The scheme of a layer made of the checkpoint layers `names` (several for a fused
        layer); None keeps it dense. Parts quantized differently are refused."""
        schemes = {name: self._scheme_of(name) for name in names}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            described = ", ".join(
                f"{name}: {scheme.describe() if scheme else 'not quantized'}"
                for name, scheme in schemes.items()
            )
            raise QuantizationConfigError(
                f"quantization_config: the parts of a fused layer are quantized differently "
                f"({described})"
            )
        return distinct.pop()

    def _scheme_of(self, name: str) -> WeightScheme | None:
        if any(self._matches(pattern, name, self.substring_ignore) for pattern in self.ignore):
            return None
        if name == "lm_head" and self.method != "compressed-tensors":
            return None  # AWQ and GPTQ never quantize the LM head
        for targets, scheme in self.groups:
            if any(self._matches(target, name, False) for target in targets):
                return scheme
        return None

    @staticmethod
    def _matches(pattern: str, name: str, substring: bool) -> bool:
        if pattern == "Linear":
            return True
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None  # as compressed-tensors matches
        if substring:
            return pattern in name
        return name == pattern or name.endswith("." + pattern)

    def describe(self) -> str:
        schemes = sorted({scheme.describe() for _, scheme in self.groups})
        return f"{self.method} ({'; '.join(schemes)})"


def parse_quantization_config(raw: Any, source: str = "config.json") -> QuantizationConfig | None:
    """config.json's `quantization_config` (or None) -> the weight schemes, refusing anything
    unsupported with a message naming the field."""
    if raw is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(raw, Mapping):
        raise QuantizationConfigError(f"{where} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "awq":
        return _awq(raw, where)
    if method == "gptq":
        return _gptq(raw, where)
    raise QuantizationConfigError(
        f"{where}: quantization method {method!r} is not supported (supported: {SUPPORTED})"
    )


def _bits(value: Any, where: str, allowed: tuple[int, ...]) -> int:
    if value not in allowed or isinstance(value, bool):
        raise QuantizationConfigError(
            f"{where} = {value!r} is not supported ({' or '.join(map(str, allowed))} bits)"
        )
    return int(value)


def _group_size(value: Any, where: str, channel_values: tuple[Any, ...]) -> int | None:
    if value in channel_values:
        return None
    if value not in GROUP_SIZES or isinstance(value, bool):
        raise QuantizationConfigError(
            f"{where} = {value!r} is not supported "
            f"(group sizes {', '.join(map(str, GROUP_SIZES))} or per channel)"
        )
    return int(value)


def _compressed_tensors(raw: Mapping[str, Any], where: str) -> QuantizationConfig:
    fmt = raw.get("format")
    if fmt != "pack-quantized":
        raise QuantizationConfigError(
            f"{where}.format = {fmt!r} is not supported (supported: {SUPPORTED})"
        )
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationConfigError(
            f"{where}.quantization_status = {status!r} is not supported (only 'compressed')"
        )
    if raw.get("kv_cache_scheme") is not None:
        raise QuantizationConfigError(
            f"{where}.kv_cache_scheme is not supported (use kv_cache_dtype='int8' instead)"
        )
    if raw.get("sparsity_config"):
        raise QuantizationConfigError(f"{where}.sparsity_config is not supported")
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, Mapping) or not groups_raw:
        raise QuantizationConfigError(f"{where}.config_groups must be a non-empty object")
    groups = []
    for name, group in groups_raw.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise QuantizationConfigError(f"{at} must be an object")
        group_format = group.get("format")
        if group_format not in (None, "pack-quantized"):
            raise QuantizationConfigError(
                f"{at}.format = {group_format!r} is not supported (supported: {SUPPORTED})"
            )
        for field in ("input_activations", "output_activations"):
            if group.get(field) is not None:
                raise QuantizationConfigError(
                    f"{at}.{field}: activation quantization is not supported "
                    f"(supported: {SUPPORTED})"
                )
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise QuantizationConfigError(f"{at}.targets must be a list of layer names")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise QuantizationConfigError(f"{at}.weights must be an object")
        kind = weights.get("type", "int")
        if kind != "int":
            raise QuantizationConfigError(
                f"{at}.weights.type = {kind!r} is not supported (supported: {SUPPORTED})"
            )
        if weights.get("dynamic", False):
            raise QuantizationConfigError(f"{at}.weights.dynamic = true is not supported")
        if weights.get("actorder") == "group":
            raise QuantizationConfigError(
                f"{at}.weights.actorder = 'group' (activation-order groups) is not supported"
            )
        bits = _bits(weights.get("num_bits"), f"{at}.weights.num_bits", (4, 8))
        strategy = weights.get("strategy")
        if strategy == "group":
            group_size = _group_size(weights.get("group_size"), f"{at}.weights.group_size", ())
        elif strategy == "channel":
            group_size = None
        else:
            raise QuantizationConfigError(
                f"{at}.weights.strategy = {strategy!r} is not supported (group or channel)"
            )
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise QuantizationConfigError(f"{at}.weights.symmetric must be true or false")
        scheme = WeightScheme("compressed-tensors", bits, group_size, symmetric)
        groups.append((tuple(targets), scheme))
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise QuantizationConfigError(f"{where}.ignore must be a list of layer names")
    return QuantizationConfig("compressed-tensors", tuple(groups), tuple(ignore))


def _awq(raw: Mapping[str, Any], where: str) -> QuantizationConfig:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationConfigError(
            f"{where}.version = {raw.get('version')!r} is not supported (AutoAWQ 'gemm' only)"
        )
    bits = _bits(raw.get("bits", raw.get("w_bit")), f"{where}.bits", (4,))
    group_size = _group_size(
        raw.get("group_size", raw.get("q_group_size")), f"{where}.group_size", (-1,)
    )
    if raw.get("zero_point", True) is not True:
        raise QuantizationConfigError(f"{where}.zero_point = false is not supported")
    ignore = raw.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise QuantizationConfigError(f"{where}.modules_to_not_convert must be a list of names")
    scheme = WeightScheme("awq", bits, group_size, symmetric=False)
    return QuantizationConfig("awq", ((("Linear",), scheme),), tuple(ignore), True)


def _gptq(raw: Mapping[str, Any], where: str) -> QuantizationConfig:
    if raw.get("desc_act", False):
        raise QuantizationConfigError(
            f"{where}.desc_act = true (act-order) is not supported: re-quantize with desc_act false"
        )
    checkpoint_format = raw.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationConfigError(
            f"{where}.checkpoint_format = {checkpoint_format!r} is not supported (gptq or gptq_v2)"
        )
    if raw.get("dynamic"):
        raise QuantizationConfigError(f"{where}.dynamic (per-layer overrides) is not supported")
    bits = _bits(raw.get("bits"), f"{where}.bits", (4, 8))
    group_size = _group_size(raw.get("group_size"), f"{where}.group_size", (-1,))
    symmetric = raw.get("sym", True)
    if not isinstance(symmetric, bool):
        raise QuantizationConfigError(f"{where}.sym must be true or false")
    offset = 1 if checkpoint_format == "gptq" else 0
    scheme = WeightScheme("gptq", bits, group_size, symmetric, zero_point_offset=offset)
    ignore = raw.get("modules_to_not_convert") or []
    return QuantizationConfig("gptq", ((("Linear",), scheme),), tuple(ignore), True)
