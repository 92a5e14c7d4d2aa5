"""How vLLM 0.28 reads a compressed-tensors quantization config: which scheme each linear gets.

* :func:`read_quantization_config` parses ``quantization_config`` with compressed-tensors' own
  pydantic model (what vLLM does, minus the KV-cache-only groups it drops).
* :func:`scheme_table` resolves which scheme each vLLM linear module gets, with vLLM 0.28's
  rules (docs/vllm-internals.md, "Quantization configs"): the ignore list first (every shard of
  a fused module must agree, else vLLM raises), then the first target matching the exact name
  or ``re:`` regex (``re.match``: anchored at the start only), then the fused-shard match (all
  shards must match), then the class-name substring. Dotted non-regex targets and ignore entries
  are renamed by the model class's HF->vLLM prefix mapper first; regexes never are, so a regex
  anchored on the checkpoint's prefix silently matches nothing in vLLM.
* :data:`FUSED_MODULES` / :data:`PLUGIN_NAME_MAP`: the fused modules and name mapping of the
  plugin's model class (:mod:`clef_vllm.worker.model` derives its own attributes from them).

Import-light: no vLLM and no torch; compressed-tensors is imported inside the parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from clef_vllm.model.layout import TEXT_BACKBONE_PREFIX, VL_BACKBONE_PREFIX

# --------------------------------------------------------------------------- names

#: vLLM fused linear module -> checkpoint shards (Qwen3.5 ``packed_modules_mapping``).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
#: Checkpoint shard -> (vLLM fused module, shard index).
SHARD_OF: dict[str, tuple[str, int]] = {s: (f, i) for f, shards in FUSED_MODULES.items() for i, s in enumerate(shards)}
#: HF -> vLLM name prefixes of the plugin's model class: a VL-shaped checkpoint's backbone
#: (``model.language_model.``) becomes ``model.``; text-only names are already ``model.``.
PLUGIN_NAME_MAP: tuple[tuple[str, str], ...] = ((VL_BACKBONE_PREFIX, TEXT_BACKBONE_PREFIX),)
#: The same for vLLM's stock ``Qwen3_5ForConditionalGeneration`` (its qwen3_vl mapper).
VL_NAME_MAP: tuple[tuple[str, str], ...] = (("model.visual.", "visual."),
                                           (VL_BACKBONE_PREFIX, "language_model.model."),
                                           ("lm_head.", "language_model.lm_head."))

UNQUANTIZED = "unquantized"
FP8_W8A8 = "fp8_w8a8"
FP8_W8A16 = "fp8_w8a16"
NVFP4_W4A4 = "nvfp4_w4a4"
NVFP4_W4A16 = "nvfp4_w4a16"


class QuantConfigError(ValueError):
    """A quantization config vLLM would refuse or mis-apply."""


# --------------------------------------------------------------------------- config


def read_quantization_config(source) -> "QuantizationConfig | None":  # noqa: F821 - lazy import
    """The checkpoint's ``quantization_config`` as compressed-tensors' ``QuantizationConfig``.

    ``source``: a checkpoint folder, its ``config.json``, the config dict, or a
    ``CheckpointFiles``. ``None`` when the checkpoint is not quantized. Config groups whose only
    target ends in ``Attention`` are dropped, as vLLM does (KV-cache quantization). Raises
    :class:`QuantConfigError` for a non-compressed-tensors method or an invalid config.
    """
    config = _config_dict(source)
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ModuleNotFoundError:
        raise QuantConfigError("reading a quantization_config needs compressed-tensors (vLLM 0.28 pins 0.17.0): "
                               "pip install 'compressed-tensors==0.17.0', or the vllm extra") from None
    from pydantic import ValidationError

    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise QuantConfigError(f"quant_method {method!r}: only compressed-tensors checkpoints are inspected here")
    qc = dict(qc)
    qc["config_groups"] = {k: v for k, v in (qc.get("config_groups") or {}).items()
                           if not (isinstance(v, dict) and len(v.get("targets") or []) == 1
                                   and str(v["targets"][0]).endswith("Attention"))}
    try:
        return QuantizationConfig.model_validate(qc)
    except ValidationError as exc:
        raise QuantConfigError(f"quantization_config does not parse with compressed-tensors: {exc}") from None


def _config_dict(source) -> dict:
    if isinstance(source, dict):
        return source
    config = getattr(source, "config", None)
    if isinstance(config, dict):
        return config
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text(encoding="utf-8"))


def scheme_kind(scheme) -> str:
    """``fp8_w8a8`` / ``fp8_w8a16`` / ``nvfp4_w4a4`` / ``nvfp4_w4a16`` / ``unquantized`` / ``other:…``.

    ``scheme``: a compressed-tensors ``QuantizationScheme`` (or ``None``).
    """
    if scheme is None or scheme.weights is None:
        return UNQUANTIZED
    w, a = scheme.weights, scheme.input_activations
    wtype, wstrat = _value(w.type), _value(w.strategy)
    if wtype == "float" and w.num_bits == 4 and wstrat == "tensor_group" and w.group_size == 16 and w.symmetric:
        return NVFP4_W4A16 if a is None else NVFP4_W4A4
    if wtype == "float" and w.num_bits == 8 and not w.dynamic and w.symmetric and wstrat in ("tensor", "channel"):
        if a is not None and _value(a.type) == "float" and a.num_bits == 8:
            return FP8_W8A8
        return FP8_W8A16
    return f"other:w{w.num_bits}{wtype}-{wstrat}" + ("" if a is None else f"/a{a.num_bits}{_value(a.type)}")


def _value(x):
    return getattr(x, "value", x)


# --------------------------------------------------------------------------- vLLM module names


@dataclass(frozen=True)
class LinearModule:
    """One vLLM linear layer of the text backbone."""

    name: str            # full vLLM name, e.g. model.layers.4.linear_attn.in_proj_qkvz
    module_class: str    # vLLM class (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    layer: int | None
    group: str           # "attention" (q/k/v/o), "gdn" (in_proj_*, out_proj) or "mlp"

    @property
    def proj(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def shards(self) -> tuple[str, ...]:
        """Checkpoint-side leaf names (the fused module's shards, or its own name)."""
        return FUSED_MODULES.get(self.proj, (self.proj,))


def vllm_linear_modules(text_config: Mapping, prefix: str = "model.") -> list[LinearModule]:
    """The linear modules vLLM's Qwen3.5 backbone builds, with their vLLM names and classes.

    ``prefix``: ``"model."`` for the plugin's class (and vLLM's text-only ``Qwen3_5ForCausalLM``),
    ``"language_model.model."`` for vLLM's VL class. GDN ``conv1d`` is built without a quant
    config and is never quantized, so it is not listed.
    """
    n = int(text_config["num_hidden_layers"])
    types = text_config.get("layer_types") or [
        "full_attention" if (i + 1) % int(text_config.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(n)]
    out = []
    for i, kind in enumerate(types):
        p = f"{prefix}layers.{i}."
        if kind == "linear_attention":
            out += [LinearModule(p + "linear_attn.in_proj_qkvz", "MergedColumnParallelLinear", i, "gdn"),
                    LinearModule(p + "linear_attn.in_proj_ba", "MergedColumnParallelLinear", i, "gdn"),
                    LinearModule(p + "linear_attn.out_proj", "RowParallelLinear", i, "gdn")]
        else:
            out += [LinearModule(p + "self_attn.qkv_proj", "QKVParallelLinear", i, "attention"),
                    LinearModule(p + "self_attn.o_proj", "RowParallelLinear", i, "attention")]
        out += [LinearModule(p + "mlp.gate_up_proj", "MergedColumnParallelLinear", i, "mlp"),
                LinearModule(p + "mlp.down_proj", "RowParallelLinear", i, "mlp")]
    return out


def map_name(name: str, name_map: Sequence[tuple[str, str]] = PLUGIN_NAME_MAP) -> str:
    """Apply the first matching HF->vLLM prefix rename."""
    for old, new in name_map:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _map_target(target: str, name_map) -> str:
    # CompressedTensorsConfig.apply_vllm_mapper: only dotted, non-regex entries are renamed.
    return map_name(target, name_map) if "." in target and not target.startswith("re:") else target


# --------------------------------------------------------------------------- vLLM matching rules


def _is_match(value: str, target: str, check_contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if check_contains:
        return target.lower() in value.lower()
    return target == value


def _first_match(value: str, targets: Iterable[str], check_contains: bool = False) -> str | None:
    return next((t for t in targets if _is_match(value, t, check_contains)), None)


def first_matching_target(name: str, targets: Iterable[str]) -> str | None:
    """The first target (exact name or ``re:`` regex, ``re.match`` semantics) matching ``name``."""
    return _first_match(name, targets)


def _shard_names(name: str) -> tuple[str, list[str]] | None:
    proj = name.rsplit(".", 1)[-1]
    if proj not in FUSED_MODULES:
        return None
    return proj, [name[: -len(proj)] + s for s in FUSED_MODULES[proj]]


@dataclass(frozen=True)
class LayerScheme:
    """The scheme one vLLM linear module gets, and why."""

    module: LinearModule
    group: str | None                 # config group name, None when unquantized
    target: str | None                # the target that matched (after renaming)
    matched_by: str                   # "ignore" | "name" | "fused-shards" | "class" | "none"
    kind: str                         # see scheme_kind
    scheme: object | None = field(default=None, repr=False, compare=False)   # QuantizationScheme
    problems: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.module.name


def resolve_scheme(module: LinearModule, qconfig, name_map: Sequence[tuple[str, str]] = PLUGIN_NAME_MAP) -> LayerScheme:
    """The scheme vLLM 0.28 assigns to ``module`` under ``qconfig`` (a ``QuantizationConfig`` or None).

    Beyond vLLM, it records problems vLLM would hit later or silently: shards of a fused module
    whose own matches point at different groups, or some quantized and some not (vLLM then loads
    shard tensors into the wrong parameter layout).
    """
    if qconfig is None:
        return LayerScheme(module, None, None, "none", UNQUANTIZED)
    ignore = [_map_target(t, name_map) for t in (qconfig.ignore or [])]
    target_map: dict[str, tuple[str, object]] = {}
    for gname, scheme in qconfig.config_groups.items():
        for t in scheme.targets:
            target_map[_map_target(t, name_map)] = (gname, scheme)
    name, problems = module.name, []

    fused = _shard_names(name)
    # should_ignore_layer
    if fused is not None and name not in ignore:
        flags = [any(_is_match(s, t) for t in ignore) for s in fused[1]]
        if len(set(flags)) > 1:
            problems.append(f"ignore list covers only some shards of {name} "
                            f"({', '.join(s.rsplit('.', 1)[-1] for s, f in zip(fused[1], flags) if f)}): "
                            "vLLM raises 'Found a different quantization schemes'")
            return LayerScheme(module, None, None, "ignore", "error", None, tuple(problems))
        ignored = flags[0]
    else:
        ignored = any(_is_match(name, t) for t in ignore)
    if ignored:
        return LayerScheme(module, None, None, "ignore", UNQUANTIZED)

    # find_matched_target: name, then fused shards (all must match), then class name
    targets = list(target_map)
    target, how = _first_match(name, targets), "name"
    if target is None and fused is not None:
        per_shard = [_first_match(s, targets) for s in fused[1]]
        if all(per_shard):
            target, how = per_shard[0], "fused-shards"
    if target is None:
        target, how = _first_match(module.module_class, targets, check_contains=True), "class"
    if fused is not None:
        per_shard = [_first_match(s, targets) for s in fused[1]]
        groups = {None if t is None else target_map[t][0] for t in per_shard}
        if len(groups) > 1 or (target is not None and groups != {target_map[target][0]} and how != "class"):
            desc = ", ".join(f"{s.rsplit('.', 1)[-1]}->{target_map[t][0] if t else 'unquantized'}"
                             for s, t in zip(fused[1], per_shard))
            problems.append(f"shards of {name} disagree ({desc}); vLLM uses "
                            f"{target_map[target][0] if target else 'unquantized'} for all of them")
    if target is None:
        return LayerScheme(module, None, None, "none", UNQUANTIZED, None, tuple(problems))
    gname, scheme = target_map[target]
    return LayerScheme(module, gname, target, how, scheme_kind(scheme), scheme, tuple(problems))


def scheme_table(source, qconfig=None, *, prefix: str = "model.",
                 name_map: Sequence[tuple[str, str]] = PLUGIN_NAME_MAP) -> list[LayerScheme]:
    """Per-module schemes of a checkpoint as vLLM 0.28 resolves them (see :func:`resolve_scheme`).

    ``source``: checkpoint folder / config.json / config dict / ``CheckpointFiles``. ``qconfig``
    defaults to the checkpoint's own config.
    """
    config = _config_dict(source)
    if qconfig is None:
        qconfig = read_quantization_config(config)
    text = config.get("text_config", config)
    return [resolve_scheme(m, qconfig, name_map) for m in vllm_linear_modules(text, prefix)]


def summarize_schemes(table: Sequence[LayerScheme]) -> dict[str, int]:
    """``{kind: number of vLLM modules}``, e.g. ``{"fp8_w8a8": 16, "nvfp4_w4a4": 16, "unquantized": 6}``."""
    out: dict[str, int] = {}
    for row in table:
        out[row.kind] = out.get(row.kind, 0) + 1
    return out
