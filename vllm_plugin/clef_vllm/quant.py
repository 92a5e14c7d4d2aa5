"""How vLLM 0.28 will see a compressed-tensors checkpoint, and how to fix its fused NVFP4 scales.

Used by the checkpoint scripts (``scripts/clef_load.py``, ``scripts/quantize_mixed.py``) and by the
plugin's model class for its startup log and load-time check. Import-light: no vLLM import at
all, and compressed-tensors / safetensors are imported inside the functions that need them.

* :func:`read_quantization_config` parses ``quantization_config`` with compressed-tensors' own
  pydantic model (what vLLM does, minus the KV-cache-only groups it drops).
* :func:`scheme_table` resolves which scheme each vLLM linear module gets, with vLLM 0.28's
  rules (vllm-notes §2.4): ignore list first (every shard of a fused module must agree, else
  vLLM raises), then the first target matching the exact name / ``re:`` regex (``re.match``:
  anchored at the start only), then the fused-shard match (all shards must match), then the
  class-name substring. Dotted non-regex targets and ignore entries are renamed by the model
  class's HF->vLLM prefix mapper first; regexes never are (risk R3).
* :func:`fused_global_scales` reads only the scalar ``*_global_scale`` tensors (``safe_open``)
  and groups them by vLLM fused module; vLLM keeps the max divisor of a group, which mis-scales
  every other shard by ``g_i / g_max`` (risk R1). :func:`unify_fused_global_scales` /
  :func:`fix_fused_global_scales` re-export the other shards at the group's min divisor
  (mixed-quant-hopper §5, fix b).
* :func:`predict_kernel` says which vLLM scheme class and GEMM kernel a scheme gets on a CUDA
  capability, with a one-line description for logs.
* NVFP4 / FP8 numerics in plain torch (no torch.compile): E2M1 rounding and packing,
  compressed-tensors' scale formulas, quantize / dequantize / fake-quant. The native exporter of
  ``scripts/quantize_mixed.py`` and the sensitivity scan use them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

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
#: HF -> vLLM name prefixes of the plugin's model class (``model.language_model.`` -> ``model.``).
PLUGIN_NAME_MAP: tuple[tuple[str, str], ...] = (("model.language_model.", "model."),)
#: The same for vLLM's stock ``Qwen3_5ForConditionalGeneration`` (qwen3_vl mapper).
VL_NAME_MAP: tuple[tuple[str, str], ...] = (("model.visual.", "visual."),
                                           ("model.language_model.", "language_model.model."),
                                           ("lm_head.", "language_model.lm_head."))

FP4_MAX = 6.0
FP8_MAX = 448.0
NVFP4_GROUP = 16
# E2M1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

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
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    config = _config_dict(source)
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
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


def layer_kinds(table: Sequence[LayerScheme]) -> dict[int, str]:
    """Per decoder layer, the kinds of its quantized modules joined by ``+`` (``"fp8_w8a8"``)."""
    per: dict[int, set[str]] = {}
    for row in table:
        if row.module.layer is not None and row.kind != UNQUANTIZED:
            per.setdefault(row.module.layer, set()).add(row.kind)
    n = max((r.module.layer for r in table if r.module.layer is not None), default=-1) + 1
    return {i: "+".join(sorted(per.get(i, {UNQUANTIZED}))) for i in range(n)}


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class KernelPrediction:
    """What vLLM 0.28 runs for one scheme on one GPU."""

    kind: str
    scheme_class: str          # CompressedTensorsW8A8Fp8 / CompressedTensorsW4A4Fp4 / UnquantizedLinearMethod
    kernel: str                # the GEMM kernel class vLLM selects first
    numerics: str              # what is actually computed, e.g. "W4A16 (weights only)"
    description: str           # one line for logs
    supported: bool = True


def parse_capability(capability) -> tuple[int, int]:
    """``(9, 0)``, ``"9.0"``, ``9.0``, ``90`` or ``"sm_90"`` -> ``(9, 0)``."""
    if isinstance(capability, tuple):
        return int(capability[0]), int(capability[1])
    text = str(capability).lower().removeprefix("sm_").removeprefix("sm")
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major), int(minor[:1] or 0)
    value = int(text)
    return (value // 10, value % 10) if value >= 10 else (value, 0)


def gpu_family(capability) -> str:
    major, minor = parse_capability(capability)
    return {7: "Turing/Volta", 8: "Ada" if minor >= 9 else "Ampere", 9: "Hopper", 10: "Blackwell",
            11: "Blackwell", 12: "Blackwell (consumer)"}.get(major, f"SM{major}{minor}")


def predict_kernel(kind: str, capability, *, linear_backend: str = "auto", flashinfer: bool = True) -> KernelPrediction:
    """The scheme class and GEMM kernel vLLM 0.28 picks for ``kind`` on a CUDA ``capability``.

    Follows ``init_fp8_linear_kernel`` / ``init_nvfp4_linear_kernel`` (vllm-notes §4): FP8 W8A8
    per-channel + dynamic per-token -> CUTLASS on SM89+; NVFP4 -> Marlin W4A16 below SM100,
    FlashInfer/CUTLASS native W4A4 on SM100+. ``linear_backend="emulation"`` forces the NVFP4
    emulation kernel (true W4A4 numerics, slow). ``flashinfer``: whether FlashInfer is installed.
    """
    cap = parse_capability(capability)
    num = cap[0] * 10 + cap[1]
    family = f"{gpu_family(cap)} GPU (SM{num})"
    if kind == UNQUANTIZED:
        return KernelPrediction(kind, "UnquantizedLinearMethod", "torch/cuBLAS GEMM", "BF16",
                                f"unquantized layers run as BF16 GEMMs on this {family}")
    if kind in (FP8_W8A8, FP8_W8A16):
        if num < 75:
            return KernelPrediction(kind, "-", "-", "-", f"FP8 is not supported on SM{num} (needs SM75+)", False)
        if kind == FP8_W8A8 and num >= 89:
            return KernelPrediction(kind, "CompressedTensorsW8A8Fp8", "CutlassFP8ScaledMMLinearKernel", "W8A8 FP8",
                                    f"FP8 W8A8 runs natively (CUTLASS, dynamic per-token FP8 activations) on this {family}")
        return KernelPrediction(kind, "CompressedTensorsW8A16Fp8", "MarlinFP8ScaledMMLinearKernel",
                                "W8A16 (weights only)",
                                f"FP8 runs as Marlin W8A16 (weights only, BF16 activations) on this {family}")
    if kind in (NVFP4_W4A4, NVFP4_W4A16):
        if num < 75:
            return KernelPrediction(kind, "-", "-", "-", f"NVFP4 is not supported on SM{num} (needs SM75+)", False)
        cls = "CompressedTensorsW4A4Fp4"
        if linear_backend == "emulation":
            return KernelPrediction(kind, cls, "EmulationNvFp4LinearKernel",
                                    "W4A4 (emulated)" if kind == NVFP4_W4A4 else "W4A16 (emulated)",
                                    f"NVFP4 runs through the emulation kernel (true FP4 numerics, slow) on this {family}")
        if kind == NVFP4_W4A4 and cap[0] in (10, 11):
            kernel = "FlashInferCuteDslNvFp4LinearKernel" if flashinfer else "CutlassNvFp4LinearKernel"
            return KernelPrediction(kind, cls, kernel, "W4A4",
                                    f"NVFP4 W4A4 runs natively ({'FlashInfer' if flashinfer else 'CUTLASS'}, "
                                    f"FP4 activations with the calibrated input global scale) on this {family}")
        if kind == NVFP4_W4A4 and cap[0] >= 12:
            kernel = "FlashInferCutlassNvFp4LinearKernel" if flashinfer else "CutlassNvFp4LinearKernel"
            return KernelPrediction(kind, cls, kernel, "W4A4",
                                    f"NVFP4 W4A4 runs natively ({'FlashInfer-CUTLASS' if flashinfer else 'CUTLASS'}) "
                                    f"on this {family}")
        what = "NVFP4 W4A4" if kind == NVFP4_W4A4 else "NVFP4 W4A16"
        return KernelPrediction(kind, cls, "MarlinNvFp4LinearKernel", "W4A16 (weights only)",
                                f"{what} runs as Marlin W4A16 (weights only, BF16 activations; the input global "
                                f"scale is unused) on this {family}")
    return KernelPrediction(kind, "?", "?", "?", f"scheme {kind} is outside the Hybrid recipe; not predicted", False)


def cuda_capability() -> tuple[int, int] | None:
    """This machine's first CUDA device capability, or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


# --------------------------------------------------------------------------- fused global scales


@dataclass(frozen=True)
class FusedScaleGroup:
    """The NVFP4 global scales (divisors) of one vLLM fused module's checkpoint shards."""

    module: str                          # checkpoint-side stem + fused name, e.g. model.language_model.layers.4.linear_attn.in_proj_qkvz
    shards: tuple[str, ...]              # checkpoint prefixes, e.g. ...linear_attn.in_proj_qkv
    weight_global_scales: tuple[float, ...]
    input_global_scales: tuple[float | None, ...]

    @property
    def weight_ok(self) -> bool:
        return len(set(self.weight_global_scales)) == 1

    @property
    def input_ok(self) -> bool:
        return len(set(self.input_global_scales)) == 1

    @property
    def ok(self) -> bool:
        return self.weight_ok and self.input_ok

    def vllm_factors(self) -> tuple[float, ...]:
        """How vLLM scales each shard's weights (it keeps the max divisor): ``g_i / g_max``."""
        top = max(self.weight_global_scales)
        return tuple(g / top for g in self.weight_global_scales)

    def describe(self) -> str:
        leaves = [s.rsplit(".", 1)[-1] for s in self.shards]
        if self.ok:
            return f"{self.module}: shared weight global scale {self.weight_global_scales[0]:g}"
        parts = [f"{n}={g:g}" for n, g in zip(leaves, self.weight_global_scales)]
        factors = ", ".join(f"{n} x{f:.3f}" for n, f in zip(leaves, self.vllm_factors()) if f != 1.0)
        msg = f"{self.module}: weight global scales differ ({', '.join(parts)}); vLLM keeps the max, so {factors}"
        if not self.input_ok:
            msg += f"; input global scales differ too ({self.input_global_scales})"
        return msg


def _global_scale_keys(keys: Iterable[str]) -> dict[str, dict[str, str]]:
    """``{shard prefix: {"weight": key, "input": key}}`` for every NVFP4 shard."""
    out: dict[str, dict[str, str]] = {}
    for key in keys:
        for suffix, slot in ((".weight_global_scale", "weight"), (".input_global_scale", "input")):
            if key.endswith(suffix):
                out.setdefault(key[: -len(suffix)], {})[slot] = key
    return out


def group_fused_shards(prefixes: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Checkpoint shard prefixes grouped by vLLM fused module: ``[(fused stem, (shard prefixes…))]``.

    Only groups whose shards are all present are returned; unfused modules are left out.
    """
    prefixes = set(prefixes)
    groups = []
    for p in sorted(prefixes):
        stem, _, leaf = p.rpartition(".")
        if leaf not in SHARD_OF or SHARD_OF[leaf][1] != 0:
            continue
        fused = SHARD_OF[leaf][0]
        shards = tuple(f"{stem}.{s}" for s in FUSED_MODULES[fused])
        if all(s in prefixes for s in shards):
            groups.append((f"{stem}.{fused}", shards))
    return groups


def fused_global_scales(source) -> list[FusedScaleGroup]:
    """Every vLLM fused NVFP4 group of a checkpoint with its shards' global scales.

    ``source``: a checkpoint folder, a ``CheckpointFiles`` or a ``{name: tensor}`` dict. On disk
    only the ``*_global_scale`` scalars are read (``safe_open``), so this is cheap on a 9B
    checkpoint.
    """
    values = _read_global_scales(source)
    groups = []
    for fused, shards in group_fused_shards(_global_scale_keys(values)):
        ws = tuple(values.get(f"{s}.weight_global_scale") for s in shards)
        if any(w is None for w in ws):
            continue
        ins = tuple(values.get(f"{s}.input_global_scale") for s in shards)
        groups.append(FusedScaleGroup(fused, shards, ws, ins))
    return groups


def _read_global_scales(source) -> dict[str, float]:
    if isinstance(source, Mapping):
        return {k: float(v.float().reshape(-1)[0]) for k, v in source.items() if k.endswith("_global_scale")}
    from safetensors import safe_open

    files = getattr(source, "weight_files", None)
    if files is None:
        from clef_vllm.checkpoint import locate_checkpoint

        files = locate_checkpoint(source).weight_files
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith("_global_scale"):
                    t = f.get_tensor(key)
                    if t.numel() != 1:
                        raise QuantConfigError(f"{path}: {key} has {t.numel()} elements, expected a scalar")
                    out[key] = float(t.float().reshape(-1)[0])
    return out


# --------------------------------------------------------------------------- NVFP4 / FP8 numerics


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, ±0.5, …, ±6} with compressed-tensors' tie rules (ties to even), clamping at ±6."""
    a = x.abs().float()
    out = torch.zeros_like(a)
    out = torch.where((a > 0.25) & (a < 0.75), 0.5, out)
    out = torch.where((a >= 0.75) & (a <= 1.25), 1.0, out)
    out = torch.where((a > 1.25) & (a < 1.75), 1.5, out)
    out = torch.where((a >= 1.75) & (a <= 2.5), 2.0, out)
    out = torch.where((a > 2.5) & (a < 3.5), 3.0, out)
    out = torch.where((a >= 3.5) & (a <= 5.0), 4.0, out)
    out = torch.where(a > 5.0, 6.0, out)
    return out * torch.sign(x.float())


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1-grid values ``[N, K]`` -> uint8 ``[N, K/2]`` (two codes per byte, low nibble first)."""
    a = values.abs().float()
    grid = torch.tensor(E2M1_VALUES, device=values.device)
    code = (a.unsqueeze(-1) - grid).abs().argmin(-1)
    code = code | (torch.signbit(values.float()).long() << 3)
    code = code.reshape(values.shape[0], -1, 2)
    return (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> float32 E2M1 values ``[N, K]``."""
    p = packed.to(torch.int32)
    codes = torch.stack((p & 0x0F, (p >> 4) & 0x0F), dim=-1).reshape(packed.shape[0], -1)
    grid = torch.tensor(E2M1_VALUES, device=packed.device)
    return grid[codes & 0x07] * torch.where((codes & 0x08) > 0, -1.0, 1.0)


def nvfp4_global_scale(amax: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' global scale, a divisor: ``448·6 / amax`` computed in ``dtype`` (the
    observer works in the model dtype, hence BF16-representable values), returned as float32 [1]."""
    amax = torch.as_tensor(amax).to(dtype).reshape(1).clamp_min(torch.finfo(dtype).tiny)
    g = ((FP8_MAX * FP4_MAX) / amax).float()   # same expression (and CPU rounding) as compressed-tensors
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_group_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 group scales ``[N, K/16]``: ``fp8(amax16 / 6 · g)``, zeros replaced by 0.125 (as compressed-tensors)."""
    # compressed-tensors computes amax/6 in the model dtype (the observer's), then scales in fp32.
    dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
    amax = weight.reshape(weight.shape[0], -1, NVFP4_GROUP).abs().amax(-1).to(dtype)
    s = (amax / FP4_MAX).float() * global_scale.float().reshape(())
    s = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.float() == 0, torch.tensor(0.125, dtype=torch.float8_e4m3fn, device=s.device), s)


def nvfp4_quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None):
    """NVFP4 weight export: ``(weight_packed uint8 [N,K/2], weight_scale fp8 [N,K/16], weight_global_scale fp32 [1])``.

    ``global_scale`` (a divisor) defaults to the tensor's own ``448·6/amax``; pass a shared one for
    fused shards. Dequantization is ``w = q · s / g``.
    """
    if weight.dim() != 2 or weight.shape[1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs a 2-D weight with K divisible by {NVFP4_GROUP}, got {tuple(weight.shape)}")
    if global_scale is None:
        global_scale = nvfp4_global_scale(weight.abs().amax(), weight.dtype if weight.is_floating_point() else torch.float32)
    global_scale = global_scale.float().reshape(1).to(weight.device)
    scale = nvfp4_group_scales(weight, global_scale)
    eff = (scale.float() / global_scale).unsqueeze(-1)
    q = e2m1_round(weight.float().reshape(weight.shape[0], -1, NVFP4_GROUP) / eff).reshape(weight.shape)
    return pack_e2m1(q), scale, global_scale


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · s / g`` as ``[N, K]`` in ``dtype``."""
    q = unpack_e2m1(packed)
    s = (scale.float() / global_scale.float().reshape(())).repeat_interleave(NVFP4_GROUP, dim=1)
    return (q * s).to(dtype)


def nvfp4_fake_quant(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize a weight through NVFP4, in the weight's dtype."""
    packed, scale, g = nvfp4_quantize(weight, global_scale)
    return nvfp4_dequantize(packed, scale, g, weight.dtype)


def nvfp4_fake_quant_activation(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """W4A4 activations: dynamic FP8 scales per 16 inputs under a static (calibrated) global divisor."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    return nvfp4_fake_quant(flat, input_global_scale.to(x.device)).reshape(shape)


def fp8_quantize_channel(weight: torch.Tensor, scale_dtype: torch.dtype | None = None):
    """FP8-E4M3 per-output-channel weights: ``(weight fp8 [N,K], weight_scale [N,1])``; ``w ≈ q · s``.

    The scale is ``amax_row / 448`` rounded to ``scale_dtype`` (default: the weight's dtype, as
    compressed-tensors stores it).
    """
    scale_dtype = scale_dtype or (weight.dtype if weight.is_floating_point() else torch.float32)
    scale = (weight.abs().amax(dim=1, keepdim=True).to(scale_dtype) / FP8_MAX)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype, device=scale.device),
                        scale)
    # compressed-tensors divides in the weight's dtype (a BF16 rounding before the FP8 one); match it.
    work = weight if weight.is_floating_point() else weight.float()
    q = (work / scale.to(work.dtype)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_fake_quant_weight(weight: torch.Tensor) -> torch.Tensor:
    q, s = fp8_quantize_channel(weight)
    return (q.float() * s.float()).to(weight.dtype)


def fp8_fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8 activations (what CUTLASS W8A8 does to the input), in x's dtype."""
    s = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


# --------------------------------------------------------------------------- fix (b): unify fused scales


@dataclass(frozen=True)
class ScaleFix:
    """One re-exported shard."""

    shard: str
    old_global_scale: float
    new_global_scale: float
    relative_change: float     # ||W' - W|| / ||W|| of the dequantized weight (the added error)


def unify_fused_global_scales(tensors: dict[str, torch.Tensor]) -> list[ScaleFix]:
    """Give every vLLM fused NVFP4 group ONE weight global scale, in place on a state dict.

    For a group with unequal divisors, g* = min g_i (the shard with the largest amax keeps its
    codes); every other shard is dequantized exactly (``W = q·s/g_i``) and re-exported at g*:
    ``s' = fp8(amax16(W)/6 · g*)``, ``q' = E2M1(W·g*/s')``. Unequal input global scales are set
    to their min. Returns what changed.
    """
    fixes = []
    for group in fused_global_scales(tensors):
        if group.ok:
            continue
        target = min(group.weight_global_scales)
        g_star = torch.tensor([target], dtype=torch.float32)
        for shard, g in zip(group.shards, group.weight_global_scales):
            if g != target:
                packed, scale = tensors[f"{shard}.weight_packed"], tensors[f"{shard}.weight_scale"]
                w = nvfp4_dequantize(packed, scale, tensors[f"{shard}.weight_global_scale"])
                new_packed, new_scale, _ = nvfp4_quantize(w, g_star)
                w2 = nvfp4_dequantize(new_packed, new_scale, g_star)
                tensors[f"{shard}.weight_packed"] = new_packed
                tensors[f"{shard}.weight_scale"] = new_scale.to(scale.dtype)
                rel = float((w2 - w).norm() / w.norm().clamp_min(1e-30))
                fixes.append(ScaleFix(shard, g, target, rel))
            tensors[f"{shard}.weight_global_scale"] = g_star.to(tensors[f"{shard}.weight_global_scale"].dtype).clone()
        if not group.input_ok and all(v is not None for v in group.input_global_scales):
            low = torch.tensor([min(group.input_global_scales)], dtype=torch.float32)
            for shard in group.shards:
                tensors[f"{shard}.input_global_scale"] = low.clone()
    return fixes


def fix_fused_global_scales(checkpoint, out: str | Path | None = None) -> list[ScaleFix]:
    """Apply :func:`unify_fused_global_scales` to a checkpoint on disk (fix b of mixed-quant-hopper §5).

    Only the safetensors files that hold a changed tensor are rewritten. ``out=None`` rewrites in
    place, each file through a temporary sibling and an atomic rename; with ``out`` the whole
    checkpoint is copied there first (temp dir + rename). Returns what changed (empty: nothing
    to fix).
    """
    import os
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    from clef_vllm.checkpoint import locate_checkpoint

    src = Path(checkpoint)
    if out is not None and Path(out).resolve() != src.resolve():
        dst = Path(out)
        if dst.exists():
            raise FileExistsError(f"{dst} exists; choose a new output folder")
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.resolve().parent))
        try:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            fixes = fix_fused_global_scales(tmp)
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return fixes

    files = locate_checkpoint(src)
    groups = [g for g in fused_global_scales(files) if not g.ok]
    if not groups:
        return []
    wanted = {f"{s}.{suffix}" for g in groups for s in g.shards
              for suffix in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
    fixes = []
    for path in files.weight_files:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if not wanted.intersection(keys):
                continue
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in keys}
        file_fixes = unify_fused_global_scales(tensors)
        if not file_fixes and all(g.ok for g in fused_global_scales(tensors)):
            continue
        fixes += file_fixes
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    remaining = [g for g in fused_global_scales(files) if not g.weight_ok]
    if remaining:  # a group split across shard files: not handled (llm-compressor keeps modules together)
        raise QuantConfigError("fused groups split across safetensors files could not be fixed: "
                               + "; ".join(g.module for g in remaining))
    return fixes


# --------------------------------------------------------------------------- recipe helpers


def layer_regex(layers: Iterable[int]) -> str:
    """A regex alternation matching exactly these layer indices as whole numbers, compactly
    (``range(17, 32)`` -> ``(1[7-9]|2[0-9]|3[01])``)."""
    nums = sorted(set(int(i) for i in layers))
    if not nums:
        raise ValueError("no layers")
    parts, by_prefix = [], {}
    for n in nums:
        s = str(n)
        by_prefix.setdefault((len(s), s[:-1]), []).append(int(s[-1]))
    for (_, prefix), digits in sorted(by_prefix.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        runs, start = [], digits[0]
        for a, b in zip(digits, digits[1:] + [None]):
            if b != a + 1:
                runs.append((start, a))
                start = b
        cls = "".join(str(a) if a == b else (f"{a}{b}" if b == a + 1 else f"{a}-{b}") for a, b in runs)
        parts.append(prefix + (cls if len(cls) == 1 else f"[{cls}]"))
    return "(" + "|".join(parts) + ")"
