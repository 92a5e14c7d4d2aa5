"""NVFP4 global scales of vLLM's fused modules: the check and the fix, in one place.

vLLM fuses q/k/v, gate/up, in_proj_qkv/in_proj_z and in_proj_b/in_proj_a into one GEMM each and
keeps ONE NVFP4 weight global scale (a divisor) per fused module: the max of its shards'. Every
other shard is then silently scaled by ``g_i / g_max`` (docs/vllm-internals.md, "NVFP4 global
scales"). So all shards of a fused module must share one scale.

* :func:`fused_global_scales` groups the scalar ``*_global_scale`` tensors of a checkpoint (on
  disk: read alone with ``safe_open``; or a ``{name: tensor}`` dict, which is what the plugin's
  model class checks while loading) by vLLM fused module.
* :func:`unify_fused_global_scales` / :func:`fix_fused_global_scales` re-export the other shards
  at the group's smallest divisor (the shard with the largest amax keeps its codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from clef_vllm.quant.numerics import nvfp4_dequantize, nvfp4_quantize
from clef_vllm.quant.schemes import FUSED_MODULES, SHARD_OF, QuantConfigError


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
        from clef_vllm.model.checkpoint import locate_checkpoint

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
    """Apply :func:`unify_fused_global_scales` to a checkpoint on disk.

    Only the safetensors files that hold a changed tensor are rewritten. ``out=None`` rewrites in
    place, each file atomically (:mod:`clef_vllm.util.atomic`); with ``out`` the whole checkpoint is
    copied there first and the copy appears only when complete. Returns what changed (empty:
    nothing to fix).
    """
    import shutil

    from safetensors import safe_open

    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.util.atomic import atomic_dir, save_safetensors

    src = Path(checkpoint)
    if out is not None and Path(out).resolve() != src.resolve():
        with atomic_dir(out) as tmp:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            return fix_fused_global_scales(tmp)

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
        save_safetensors(tensors, path, metadata=metadata)
    remaining = [g for g in fused_global_scales(files) if not g.weight_ok]
    if remaining:  # a group split across shard files: not handled (llm-compressor keeps modules together)
        raise QuantConfigError("fused groups split across safetensors files could not be fixed: "
                               + "; ".join(g.module for g in remaining))
    return fixes
