"""``clef-load``: check any Clef checkpoint folder the way the plugin and vLLM 0.28 will load it.

Reports, section by section: the layout; the joint head config and its ``requires_clef_vllm``
marker; the head tensors; the token tables (int8 + row scales, or 16-bit in the backbone); the
quantization config parsed by compressed-tensors and the scheme every vLLM linear module
resolves to (per layer); missing, unexpected, mis-shaped and non-finite backbone tensors; NVFP4
global-scale consistency across vLLM's fused modules; and the kernels vLLM will pick on this GPU
(or ``--capability 9.0``). Uses the plugin's loaders (``clef_vllm.model.checkpoint``,
``clef_vllm.model.tables``, ``clef_vllm.quant``). Exit status 1 when anything would fail or silently
mis-compute. With ``--gpu-memory``, it prints the checkpoint's GPU memory plan for a device of that size
instead (:mod:`clef_vllm.plan.memory_plan`; no GPU needed) and exits 1 when the plan does not fit.

    clef-load CKPT
    clef-load CKPT --gpu-memory 16GiB [--gpu-memory-utilization 0.9 --max-model-len 16384 --text-only]
    clef-load CKPT --capability 9.0 --json report.json
    clef-load CKPT --fix-fused-scales --out FIXED     # re-export shards at one fused global scale
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clef_vllm.contract import DEFAULT_NVFP4_KERNEL, NVFP4_KERNELS
from clef_vllm.model.layout import linear_shapes, text_config
from clef_vllm.quant import kernels as K
from clef_vllm.quant import schemes as S
from clef_vllm.util.atomic import write_json

OK, ERROR = "ok", "error"


@dataclass
class Finding:
    section: str
    level: str
    message: str


@dataclass
class Report:
    """Everything clef_load found; ``ok`` is False when any finding is an error."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    kernels: list[dict] = field(default_factory=list)
    schemes: dict = field(default_factory=dict)

    def add(self, section: str, level: str, message: str) -> None:
        self.findings.append(Finding(section, level, message))

    @property
    def ok(self) -> bool:
        return not any(f.level == ERROR for f in self.findings)

    def errors(self) -> list[str]:
        return [f"{f.section}: {f.message}" for f in self.findings if f.level == ERROR]

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "findings": [asdict(f) for f in self.findings],
                "layers": self.layers, "kernels": self.kernels, "schemes": self.schemes}


# --------------------------------------------------------------------------- expected tensors


def expected_tensor_shapes(config: dict, table, tables_in_head: bool, prefix: str) -> dict[str, tuple[str, tuple]]:
    """``{checkpoint name: (dtype name, shape)}`` the text backbone must hold (``dtype`` "16bit"
    for any 16/32-bit float)."""
    text = text_config(config)
    shapes = linear_shapes(text)
    h, vocab = text["hidden_size"], text["vocab_size"]
    out: dict[str, tuple[str, tuple]] = {}
    for row in table:
        stem = prefix + row.name[len("model."):].rsplit(".", 1)[0]
        for shard in row.module.shards:
            n, k = shapes[shard]
            base = f"{stem}.{shard}"
            if row.kind in (S.FP8_W8A8, S.FP8_W8A16):
                out[base + ".weight"] = ("F8_E4M3", (n, k))
                out[base + ".weight_scale"] = ("scale", (n, 1))
            elif row.kind in (S.NVFP4_W4A4, S.NVFP4_W4A16):
                out[base + ".weight_packed"] = ("U8", (n, k // 2))
                out[base + ".weight_scale"] = ("F8_E4M3", (n, k // 16))
                out[base + ".weight_global_scale"] = ("F32", (1,))
                if row.kind == S.NVFP4_W4A4:
                    out[base + ".input_global_scale"] = ("F32", (1,))
            else:
                out[base + ".weight"] = ("16bit", (n, k))
    types = text.get("layer_types") or []
    kh, vh, kd, vd = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
                      text["linear_value_head_dim"])
    hd = text.get("head_dim") or h // text["num_attention_heads"]
    for i, kind in enumerate(types):
        p = f"{prefix}layers.{i}."
        out[p + "input_layernorm.weight"] = ("16bit", (h,))
        out[p + "post_attention_layernorm.weight"] = ("16bit", (h,))
        if kind == "linear_attention":
            out[p + "linear_attn.conv1d.weight"] = ("16bit", (2 * kh * kd + vh * vd, 1, text["linear_conv_kernel_dim"]))
            out[p + "linear_attn.A_log"] = ("16bit", (vh,))
            out[p + "linear_attn.dt_bias"] = ("16bit", (vh,))
            out[p + "linear_attn.norm.weight"] = ("16bit", (vd,))
        else:
            out[p + "self_attn.q_norm.weight"] = ("16bit", (hd,))
            out[p + "self_attn.k_norm.weight"] = ("16bit", (hd,))
    out[prefix + "norm.weight"] = ("16bit", (h,))
    if not tables_in_head:
        out[prefix + "embed_tokens.weight"] = ("16bit", (vocab, h))
        out["lm_head.weight"] = ("16bit", (vocab, h))
    return out


_FLOAT16 = {"BF16", "F16", "F32"}


def _dtype_ok(want: str, got: str) -> bool:
    if want == "16bit":
        return got in _FLOAT16
    if want == "scale":
        return got in _FLOAT16
    return want == got


# --------------------------------------------------------------------------- the checks


def check_config_only(path: str | Path, capability=None, prefix: str = "model.",
                      nvfp4_kernel: str = DEFAULT_NVFP4_KERNEL) -> Report:
    """Checks that need no weights (a checkpoint whose weights are build outputs): config.json's
    quantization config and per-module schemes, the head config and marker, the kernels."""
    from clef_vllm.model.checkpoint import HEAD_CONFIG, HEAD_DIR, CheckpointError, check_version_marker
    from clef_vllm.model.head import HeadConfig, HeadConfigError

    root = Path(path)
    report = Report(str(path))
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    report.add("layout", OK, f"config only; architectures {config.get('architectures')}")
    head_file = root / HEAD_DIR / HEAD_CONFIG if (root / HEAD_DIR / HEAD_CONFIG).is_file() else root / HEAD_CONFIG
    try:
        head = HeadConfig.from_dict(json.loads(head_file.read_text(encoding="utf-8")), str(head_file))
        check_version_marker(head.requires_clef_vllm, head_file)
        hidden = text_config(config).get("hidden_size")
        level = OK if head.hidden_size == hidden else ERROR
        report.add("head", level, f"{head_file.relative_to(root)}: hidden {head.hidden_size} (backbone {hidden}), width "
                                  f"{head.width}; requires_clef_vllm {head.requires_clef_vllm} (satisfied)")
        if head.requires_clef_vllm is None:
            report.add("head", ERROR, f"{head_file}: no requires_clef_vllm marker")
    except (OSError, HeadConfigError, CheckpointError, ValueError) as exc:
        report.add("head", ERROR, str(exc))
    _check_quantization(report, config, prefix)
    _predict_kernels(report, capability, nvfp4_kernel)
    return report


def check_checkpoint(path: str | Path, capability=None, check_values: bool = True, prefix: str = "model.",
                     nvfp4_kernel: str = DEFAULT_NVFP4_KERNEL) -> Report:
    """Run every check on the checkpoint at ``path``; never raises for a bad checkpoint."""
    from safetensors import safe_open

    from clef_vllm.model.checkpoint import CheckpointError, load_head_config, load_head_state, locate_checkpoint
    from clef_vllm.model.layout import NOT_TEXT_PREFIXES, VISION_PREFIXES
    from clef_vllm.model.tables import TableError, load_int8_tables
    from clef_vllm.quant.fused_scales import fused_global_scales

    report = Report(str(path))
    try:
        files = locate_checkpoint(path)
    except CheckpointError as exc:
        report.add("layout", ERROR, str(exc))
        return report
    text = files.text_config
    report.add("layout", OK, f"{files.layout} layout; {len(files.weight_files)} backbone file(s)"
                             f"{' + index' if files.index_file else ''}; architectures {files.config.get('architectures')}")

    # head config, marker, head tensors
    try:
        head_cfg = load_head_config(files)
        marker = head_cfg.requires_clef_vllm
        report.add("head", OK, f"{files.head_config_file.relative_to(files.root)}: width {head_cfg.width}, "
                               f"{head_cfg.routing_layers} routing + {head_cfg.layers} decoder layers, {head_cfg.heads} heads; "
                               + (f"requires_clef_vllm {marker} (satisfied)" if marker else "no requires_clef_vllm marker"))
        if marker is None and files.layout == "repacked":
            report.add("head", ERROR, f"{files.head_config_file}: repacked checkpoint without requires_clef_vllm "
                                      "(run clef-shrink-tables)")
        state = load_head_state(files, head_cfg)
        report.add("head", OK, f"{files.head_weights_file.name}: {len(state)} tensors, "
                               f"{sum(t.numel() for t in state.values()):,} parameters, all finite")
    except CheckpointError as exc:
        report.add("head", ERROR, str(exc))

    # token tables
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if files.tables_file is not None:
        try:
            tables = load_int8_tables(files.tables_file)
            for name, t in tables.items():
                level = OK if (t.num_rows, t.width) == (vocab, hidden) else ERROR
                report.add("tables", level, f"{name}: int8 {t.num_rows} x {t.width} + float32 row scales"
                                            + ("" if level == OK else f" (config says {vocab} x {hidden})"))
        except (TableError, OSError, Exception) as exc:  # noqa: BLE001 - report any unreadable table file
            report.add("tables", ERROR, f"{files.tables_file}: {exc}")
    else:
        report.add("tables", OK, "embed_tokens and lm_head in the backbone files (release layout, 16-bit)")

    # quantization config and per-module schemes
    table = _check_quantization(report, files.config, prefix)

    # tensors: missing / unexpected / shapes / non-finite
    if table:
        expected = expected_tensor_shapes(files.config, table, files.tables_file is not None, files.backbone_prefix)
        seen, unexpected, bad_shape, non_finite, mtp = set(), [], [], [], 0
        vision = {"tensors": 0, "parameters": 0, "not_16_bit": []}
        import torch

        for wf in files.weight_files:
            with safe_open(str(wf), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                    if key.startswith(VISION_PREFIXES):
                        vision["tensors"] += 1
                        vision["parameters"] += math.prod(shape)
                        if dtype not in ("BF16", "F16", "F32"):
                            vision["not_16_bit"].append(f"{key}: {dtype}")
                        want = None
                    elif key.startswith(NOT_TEXT_PREFIXES):
                        mtp += 1
                        want = None
                    elif key in expected:
                        seen.add(key)
                        want = expected[key]
                        if not _dtype_ok(want[0], dtype) or shape != want[1]:
                            bad_shape.append(f"{key}: {dtype} {list(shape)}, expected {want[0]} {list(want[1])}")
                    else:
                        unexpected.append(key)
                        want = None
                    if check_values and dtype in ("BF16", "F16", "F32", "F8_E4M3"):
                        t = f.get_tensor(key)
                        if not bool(torch.isfinite(t.float()).all()):
                            non_finite.append(key)
        missing = sorted(set(expected) - seen)
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong dtype/shape", bad_shape),
                             ("non-finite", non_finite)):
            if items:
                report.add("tensors", ERROR, f"{len(items)} {label}: " + "; ".join(items[:6])
                                             + (" ..." if len(items) > 6 else ""))
        if not (missing or unexpected or bad_shape or non_finite):
            report.add("tensors", OK, f"all {len(expected)} expected text-backbone tensors present with the right dtype "
                                      f"and shape" + (", all finite" if check_values else " (values not read)")
                                      + (f"; skipped {mtp} mtp (not loaded by the plugin)" if mtp else ""))
        if vision["not_16_bit"]:
            report.add("vision", ERROR, f"{len(vision['not_16_bit'])} vision tower tensor(s) not 16-bit (both backends "
                                        "run the tower unquantized): " + "; ".join(vision["not_16_bit"][:4]))
        elif vision["tensors"]:
            report.add("vision", OK, f"vision tower: {vision['tensors']} tensors, {vision['parameters']:,} parameters "
                                     f"({2 * vision['parameters'] / 2 ** 30:.2f} GiB in BF16); both backends load it "
                                     "unless --text-only")

    # fused NVFP4 global scales
    try:
        groups = fused_global_scales(files)
        bad = [g for g in groups if not g.ok]
        for g in bad:
            report.add("fused scales", ERROR, g.describe() + " (fix: clef-load CKPT --fix-fused-scales --out FIXED)")
        if groups and not bad:
            report.add("fused scales", OK, f"all {len(groups)} fused NVFP4 groups share one weight global scale "
                                           "(and one input global scale)")
        elif not groups:
            report.add("fused scales", OK, "no NVFP4 fused groups")
    except Exception as exc:  # noqa: BLE001
        report.add("fused scales", ERROR, f"could not read global scales: {exc}")

    _predict_kernels(report, capability, nvfp4_kernel)
    return report


def _check_quantization(report: Report, config: dict, prefix: str) -> list:
    """Parse quantization_config with compressed-tensors and resolve every vLLM module's scheme."""
    table = []
    text = text_config(config)
    try:
        qconfig = S.read_quantization_config(config)
        table = S.scheme_table(config, qconfig, prefix=prefix)
        if qconfig is None:
            report.add("quantization", OK, "not quantized (16-bit backbone)")
        else:
            import compressed_tensors

            report.add("quantization", OK, f"compressed-tensors config parses with compressed-tensors "
                                           f"{compressed_tensors.__version__} (written by "
                                           f"{config['quantization_config'].get('version', '?')}); format {qconfig.format}; "
                                           f"groups {', '.join(qconfig.config_groups)}; {len(qconfig.ignore or [])} ignore entries")
        report.schemes = S.summarize_schemes(table)
        for row in table:
            for problem in row.problems:
                report.add("quantization", ERROR, problem)
        per_layer: dict[int, dict] = {}
        for row in table:
            entry = per_layer.setdefault(row.module.layer, {"layer": row.module.layer, "modules": {}})
            entry["modules"][row.module.proj] = row.kind
        types = text.get("layer_types") or []
        for i, entry in sorted(per_layer.items()):
            entry["type"] = "GDN" if i < len(types) and types[i] == "linear_attention" else "attention"
            report.layers.append(entry)
    except S.QuantConfigError as exc:
        report.add("quantization", ERROR, str(exc))
    return table


def _predict_kernels(report: Report, capability, nvfp4_kernel: str = DEFAULT_NVFP4_KERNEL) -> None:
    cap = capability if capability is not None else K.cuda_capability()
    assumed = cap is None
    cap = (9, 0) if cap is None else K.parse_capability(cap)
    for kind in sorted(set(report.schemes) or {S.UNQUANTIZED}):
        if kind == "error":
            continue
        k = K.predict_kernel(kind, cap, nvfp4_kernel=nvfp4_kernel)
        report.kernels.append({"kind": kind, "modules": report.schemes.get(kind, 0), "scheme_class": k.scheme_class,
                               "kernel": k.kernel, "numerics": k.numerics, "description": k.description,
                               "capability": f"{cap[0]}.{cap[1]}", "assumed_capability": assumed})
        report.add("kernels", OK if k.supported else ERROR,
                   f"{kind} ({report.schemes.get(kind, 0)} modules): {k.scheme_class} -> {k.kernel}. {k.description}"
                   + (" [capability assumed: no GPU here; pass --capability]" if assumed else ""))


def format_layers(report: Report) -> list[str]:
    """One line per decoder layer: index, mixer type and the kind of each vLLM module."""
    short = {"fp8_w8a8": "FP8", "fp8_w8a16": "FP8-W8A16", "nvfp4_w4a4": "NVFP4", "nvfp4_w4a16": "NVFP4-A16",
             "unquantized": "BF16", "error": "ERROR"}
    lines = []
    for entry in report.layers:
        mods = "  ".join(f"{name}={short.get(kind, kind)}" for name, kind in entry["modules"].items())
        lines.append(f"  {entry['layer']:3d} {entry['type']:9s} {mods}")
    return lines


def print_memory_plan(a) -> int:
    """``--gpu-memory``: the fitted memory plan (or why none fits), and ``--json`` with it; the exit status."""
    from clef_vllm.backends.memory_fit import plan_for_checkpoint
    from clef_vllm.backends.options import VllmOptions
    from clef_vllm.model.checkpoint import CheckpointError
    from clef_vllm.plan import memory_plan as MP

    result: dict = {"path": str(a.checkpoint), "device_total_bytes": a.gpu_memory}
    try:
        given = dict(max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization,
                     max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
        options = VllmOptions(nvfp4_kernel=a.nvfp4_kernel, text_only=a.text_only,
                              **{k: v for k, v in given.items() if v is not None})
        plan = plan_for_checkpoint(a.checkpoint, device_total_bytes=a.gpu_memory, options=options,
                                      capability=a.capability)
    except (MP.PlanDoesNotFit, CheckpointError, ValueError) as exc:
        print(f"DOES NOT FIT: {exc}" if isinstance(exc, MP.PlanDoesNotFit) else f"ERROR: {exc}")
        result.update(ok=False, error=str(exc))
        ok = False
    else:
        print(f"device {MP.gib(a.gpu_memory)} GiB x --gpu-memory-utilization "
              f"{options.resolved_gpu_memory_utilization:g}")
        print("\n".join(plan.describe()))
        result.update(ok=True, plan=plan.to_dict())
        ok = True
    if a.json:
        write_json(a.json, result)
    print(("PASS" if ok else "FAIL") + f": {a.checkpoint}")
    return 0 if ok else 1


def _size(text: str) -> int:
    from clef_vllm.plan.memory_plan import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def missing_dependency(checkpoint: Path) -> str | None:
    """The one line to print instead of a report when this environment cannot check ``checkpoint``: a
    compressed-tensors checkpoint needs the ``compressed-tensors`` package (not in the plugin's base install)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        quantized = "quantization_config" in config or "quantization_config" in config.get("text_config", {})
    except (OSError, ValueError, AttributeError):
        return None                               # no readable config: the report says so
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        if quantized:
            return (f"clef-load: {checkpoint} is quantized (compressed-tensors) and this environment has no "
                    "compressed-tensors: pip install './vllm_plugin[vllm]' (or 'compressed-tensors==0.17.0')")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="clef-load", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--capability", help="CUDA capability to predict kernels for, e.g. 9.0 (default: this GPU)")
    ap.add_argument("--nvfp4-kernel", default=DEFAULT_NVFP4_KERNEL, choices=NVFP4_KERNELS,
                    help=f"predict for clef-systemone's --nvfp4-kernel (default {DEFAULT_NVFP4_KERNEL}, as the server's)")
    ap.add_argument("--skip-values", action="store_true", help="do not read tensor values (no non-finite check)")
    ap.add_argument("--prefix", default="model.", help="vLLM module prefix ('model.' for the plugin's class, "
                                                       "'language_model.model.' for vLLM's VL class)")
    ap.add_argument("--config-only", action="store_true", help="check config.json and the head config only "
                                                                "(weights not built yet, e.g. the repo root)")
    ap.add_argument("--json", type=Path, help="also write the report (or the memory plan) as JSON")
    ap.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                    help="print the GPU memory plan for a device of SIZE (16GiB, 15.92GiB, 24GB = 10^9 bytes, "
                         "16303MiB, bytes) instead of the checks; exit 1 when it does not fit")
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
        ap.add_argument(flag, type=float if flag == "--gpu-memory-utilization" else int,
                        help=f"with --gpu-memory: the server's {flag} (default: the server's)")
    ap.add_argument("--text-only", action="store_true", help="with --gpu-memory: the server's --text-only (no vision "
                                                              "tower)")
    ap.add_argument("--quiet", action="store_true", help="print only problems and the verdict")
    ap.add_argument("--fix-fused-scales", action="store_true",
                    help="first re-export NVFP4 shards of vLLM-fused modules at their group's shared (min) weight "
                         "global scale (in place, or to --out), then check the result")
    ap.add_argument("--out", type=Path, help="with --fix-fused-scales: write the fixed checkpoint here")
    a = ap.parse_args(argv)
    missing = missing_dependency(a.checkpoint)
    if missing:
        print(missing, file=sys.stderr)
        return 1
    if a.gpu_memory is not None:
        return print_memory_plan(a)
    if a.fix_fused_scales:
        from clef_vllm.quant.fused_scales import fix_fused_global_scales

        fixes = fix_fused_global_scales(a.checkpoint, a.out)
        for fix in fixes:
            print(f"[fix] {fix}")
        print(f"[fix] {len(fixes)} shard(s) re-exported" if fixes else "[fix] nothing to fix")
        a.checkpoint = a.out or a.checkpoint
    if a.config_only:
        report = check_config_only(a.checkpoint, a.capability, a.prefix, a.nvfp4_kernel)
    else:
        report = check_checkpoint(a.checkpoint, a.capability, not a.skip_values, a.prefix, a.nvfp4_kernel)
    section = None
    for f in report.findings:
        if a.quiet and f.level == OK:
            continue
        if f.section != section:
            if section == "quantization" and report.layers and not a.quiet:
                print("  per-layer schemes (vLLM modules):")
                print("\n".join(format_layers(report)))
            section = f.section
            print(f"[{section}]")
        print(f"  {'OK ' if f.level == OK else f.level.upper()}: {f.message}")
    if a.json:
        write_json(a.json, report.to_dict())
    print(("PASS" if report.ok else "FAIL") + f": {a.checkpoint}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
