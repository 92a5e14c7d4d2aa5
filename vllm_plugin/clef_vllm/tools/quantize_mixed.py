"""``clef-quantize-mixed``: build the "Hybrid" checkpoint: layers < K in FP8 W8A8, layers >= K in NVFP4 W4A4.

One llm-compressor ``QuantizationModifier`` with two config groups (the recipe is data:
:mod:`clef_vllm.quant.recipe`; ``recipe.yaml`` documents it):

* layers < K: FP8-E4M3 weights with one scale per output channel, activations quantized
  dynamically per token (no calibration);
* layers >= K: NVFP4 weights (E2M1 codes in 16-element groups, FP8-E4M3 group scales, one FP32
  global scale), NVFP4 activations whose global scale is calibrated on ``build_data`` records
  encoded exactly as the server encodes requests (``clef_vllm.schema.encoding.RequestEncoder``).

Covered: MLP gate/up/down, full-attention q/k/v/o, GDN in_proj_qkv / in_proj_z / out_proj. Kept
16-bit: GDN in_proj_a / in_proj_b, conv1d, norms, embeddings, lm_head, the vision tower and the
joint head. Targets are prefix-agnostic regexes (``re:.*layers\\.(...)\\.mlp\\.(...)$``) so they
match vLLM's module names as well as the checkpoint's; vLLM never renames regex targets.

vLLM fuses q/k/v, gate/up and in_proj_qkv/in_proj_z into one GEMM each and keeps ONE NVFP4 weight
global scale per fused module (the max divisor), so every shard of such a group must share it
(:mod:`clef_vllm.quant.fused_scales`). llm-compressor 0.14 fuses q/k/v and gate/up only; this tool
adds ``("in_proj_qkv", "in_proj_z")`` to ``llmcompressor.observers.helpers.FUSED_LAYER_NAMES``
before ``oneshot`` and then verifies the output with ``fused_global_scales``.

Engines: ``llmcompressor`` (default; needs the .venv-quant environment, see
scripts/install-dev.sh) and ``native`` (the same format written by this repo's own exporter,
:mod:`clef_vllm.quant.numerics`; used where llm-compressor is not installed, e.g. the GPU box).

    .venv-quant/bin/clef-quantize-mixed --source CKPT --split 17 --data data/ --out CKPT-hybrid
    clef-quantize-mixed --emit-config-only --out .     # the repository's root config.json, recipe.yaml, head config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from clef_vllm.model.layout import backbone_prefix, text_config
from clef_vllm.quant.recipe import (DEFAULT_SPLIT_9B, FP8_GROUP, GDN_FUSED, NVFP4_GROUP, RECIPE_IGNORE,
                                    hybrid_config_groups, ignore_list, quantization_config, write_recipe)
from clef_vllm.util.atomic import atomic_dir, save_safetensors, write_json

# --------------------------------------------------------------------------- calibration data


def calibration_ids(data: str | Path | None, tokenizer_dir: Path, num: int, max_len: int) -> list[list[int]]:
    """Token ids of ``num`` build_data records encoded by the package's RequestEncoder."""
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.protocol import RequestError
    from clef_vllm.schema.records import read_records, request_body
    from clef_vllm.tools.build_data import synthetic_records

    records = read_records(data) if data else synthetic_records(10 * num)
    encoder = RequestEncoder.from_pretrained(tokenizer_dir, max_length=max_len)
    out = []
    for r in records:
        try:
            out.append(encoder.encode(parse_request(request_body(r))).input_ids)
        except RequestError:   # schema longer than --max-seq-length: skip the record
            continue
        if len(out) >= num:
            break
    if not out:
        raise SystemExit(f"no calibration record fits --max-seq-length {max_len}")
    return out


# --------------------------------------------------------------------------- engines


def load_hf_model(source: Path, config: dict):
    """The BF16 model, VL class for a VL checkpoint (vision tower kept), else the text-only class."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if "text_config" in config else Qwen3_5ForCausalLM
    return cls.from_pretrained(str(source), dtype=torch.bfloat16).eval()


def quantize_llmcompressor(source: Path, out: Path, config: dict, split: int, ids: list[list[int]],
                           max_len: int, fuse_gdn: bool = True, device: str = "cpu") -> None:
    """llm-compressor ``oneshot`` with the Hybrid recipe; writes the compressed checkpoint to ``out``."""
    import llmcompressor.observers.helpers as observer_helpers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoTokenizer

    if fuse_gdn and GDN_FUSED not in observer_helpers.FUSED_LAYER_NAMES:
        observer_helpers.FUSED_LAYER_NAMES.append(GDN_FUSED)
    text = text_config(config)
    groups = hybrid_config_groups(text["num_hidden_layers"], split)
    model = load_hf_model(source, config)
    if device != "cpu":
        model = model.to(device)   # the 9B: calibrate on the GPU (about 19 GB in BF16)
    modifier = QuantizationModifier(config_groups=groups, ignore=RECIPE_IGNORE)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    oneshot(model=model, dataset=dataset, recipe=modifier, max_seq_length=max_len,
            processor=AutoTokenizer.from_pretrained(str(source)),
            num_calibration_samples=len(ids), pipeline="sequential" if "text_config" not in config else "basic")
    model.save_pretrained(str(out), save_compressed=True, max_shard_size="5GB")


def quantize_native(source: Path, out: Path, config: dict, split: int, ids: list[list[int]], device: str = "cpu") -> None:
    """The same checkpoint format without llm-compressor: weights through ``clef_vllm.quant``
    (compressed-tensors' formulas), NVFP4 input global scales from a calibration forward of the
    reference backbone, fused groups sharing the max-amax divisor."""
    import torch
    from safetensors import safe_open

    from clef_vllm.backends.reference import load_text_backbone
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.quant import numerics as N
    from clef_vllm.quant.fused_scales import group_fused_shards
    from clef_vllm.quant.schemes import first_matching_target

    files = locate_checkpoint(source)
    text = text_config(config)
    groups = hybrid_config_groups(text["num_hidden_layers"], split)
    hf_prefix = backbone_prefix(config)

    def group_of(name: str) -> str | None:
        for gname, g in groups.items():
            if first_matching_target(name, g["targets"]) is not None:
                return gname
        return None

    # 1. calibration: running max |input| of every NVFP4-covered Linear.
    amax_in: dict[str, float] = {}
    if NVFP4_GROUP in groups:
        model, _ = load_text_backbone(files, torch.device(device))
        hooks = []
        for name, module in model.named_modules():
            full = hf_prefix + name
            if isinstance(module, torch.nn.Linear) and group_of(full) == NVFP4_GROUP:
                def hook(mod, args, full=full):
                    amax_in[full] = max(amax_in.get(full, 0.0), float(args[0].abs().amax()))
                hooks.append(module.register_forward_pre_hook(hook))
        with torch.inference_mode():
            for seq in ids:
                model(input_ids=torch.tensor([seq], device=device), use_cache=False)
        for h in hooks:
            h.remove()
        del model

    # 2. weight amax per covered tensor (fused NVFP4 shards share the divisor of their joint amax).
    weight_amax: dict[str, float] = {}
    for path in files.weight_files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight") and group_of(key[: -len(".weight")]) == NVFP4_GROUP:
                    weight_amax[key[: -len(".weight")]] = float(f.get_tensor(key).abs().amax())
    shared: dict[str, float] = {}
    for _, shards in group_fused_shards(weight_amax):
        top = max(weight_amax[s] for s in shards)
        top_in = max(amax_in.get(s, 0.0) for s in shards)
        for s in shards:
            shared[s] = top
            amax_in[s] = top_in

    # 3. export, file by file, keeping the source sharding (finalize_weights writes the index).
    for path in files.weight_files:
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                stem = key[: -len(".weight")] if key.endswith(".weight") else None
                g = group_of(stem) if stem else None
                if g == FP8_GROUP:
                    q, s = N.fp8_quantize_channel(t.to(device))
                    tensors[key], tensors[f"{stem}.weight_scale"] = q.cpu(), s.cpu()
                elif g == NVFP4_GROUP:
                    gs = N.nvfp4_global_scale(shared.get(stem, weight_amax[stem]), t.dtype)
                    packed, scale, gs = N.nvfp4_quantize(t.to(device), gs)
                    tensors[f"{stem}.weight_packed"], tensors[f"{stem}.weight_scale"] = packed.cpu(), scale.cpu()
                    tensors[f"{stem}.weight_global_scale"] = gs.cpu()
                    tensors[f"{stem}.input_global_scale"] = N.nvfp4_global_scale(amax_in.get(stem, 0.0) or 1.0, t.dtype)
                else:
                    tensors[key] = t
        save_safetensors(dict(sorted(tensors.items())), out / path.name)
    out_config = dict(config)
    out_config["quantization_config"] = quantization_config(config, split, ignore_list(config))
    write_json(out / "config.json", out_config)


# --------------------------------------------------------------------------- the output folder


def weight_files_of(out: Path) -> list[Path]:
    """Backbone safetensors files written by an engine (not the head)."""
    index = out / "model.safetensors.index.json"
    if index.is_file():
        return [out / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(p for p in out.glob("model*.safetensors"))


def finalize_weights(source_files, out: Path) -> dict:
    """Make the backbone files of ``out`` final, whatever engine wrote them:

    * drop ``mtp.*`` (vLLM and the plugin skip the MTP head; the prefix-agnostic regexes would
      otherwise quantize ``mtp.layers.0.*`` with layer 0's scheme);
    * restore every 16-bit tensor that is not quantized from the source, bit for bit
      (llm-compressor round-trips Qwen3.5's zero-centred norms through ``1 + w`` in BF16, which
      moves some of them by one BF16 step);
    * write ``model.safetensors.index.json`` (the loader then never mistakes
      ``joint_head.safetensors`` for a backbone file).
    """
    from safetensors import safe_open

    from clef_vllm.model.checkpoint import find_backbone_tensor

    dropped = restored = 0
    weight_map, total = {}, 0
    for path in weight_files_of(out):
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        changed = False
        for key in list(tensors):
            if key.startswith("mtp."):
                del tensors[key]
                dropped += 1
                changed = True
                continue
            t = tensors[key]
            if t.dtype in (torch_dtype("bfloat16"), torch_dtype("float16"), torch_dtype("float32")):
                src = find_backbone_tensor(source_files, (key,))
                if src is not None and src.dtype == t.dtype and src.shape == t.shape and not src.equal(t):
                    tensors[key] = src
                    restored += 1
                    changed = True
        if changed:
            save_safetensors(dict(sorted(tensors.items())), path)
        weight_map.update({k: path.name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)
    return {"dropped_mtp": dropped, "restored": restored}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "README.md", "LICENSE")


def copy_side_files(files, out: Path) -> None:
    """Tokenizer, chat template and other small files, and the joint head in its layout."""
    from clef_vllm.model.checkpoint import HEAD_DIR, TABLES

    for name in COPIED:
        if (files.root / name).is_file() and not (out / name).exists():
            shutil.copy2(files.root / name, out / name)
    head_dir = out / HEAD_DIR if files.layout == "repacked" else out
    head_dir.mkdir(exist_ok=True)
    shutil.copy2(files.head_config_file, head_dir / files.head_config_file.name)
    shutil.copy2(files.head_weights_file, head_dir / files.head_weights_file.name)
    if files.tables_file is not None:
        shutil.copy2(files.tables_file, head_dir / TABLES)


def verify_output(out: Path, split: int) -> list[str]:
    """Problems of a written checkpoint: vLLM scheme resolution, per-layer split, fused scales."""
    from clef_vllm.quant.fused_scales import fused_global_scales
    from clef_vllm.quant.schemes import FP8_W8A8, NVFP4_W4A4, UNQUANTIZED, scheme_table

    problems = []
    table = scheme_table(out)
    for row in table:
        problems += list(row.problems)
        covered = row.module.proj != "in_proj_ba"
        want = (FP8_W8A8 if row.module.layer < split else NVFP4_W4A4) if covered else UNQUANTIZED
        if row.kind != want:
            problems.append(f"{row.name}: vLLM resolves {row.kind}, the recipe wants {want}")
    problems += [g.describe() for g in fused_global_scales(out) if not g.ok]
    return problems


def run(source: Path, out: Path, split: int, data, engine: str, num_samples: int, max_len: int, fix_scales: bool,
        fuse_gdn: bool, device: str) -> dict:
    from clef_vllm.model.checkpoint import EMBED_KEYS, find_backbone_tensor, locate_checkpoint
    from clef_vllm.quant.fused_scales import fix_fused_global_scales, fused_global_scales
    from clef_vllm.quant.schemes import scheme_table, summarize_schemes

    files = locate_checkpoint(source)
    config = files.config
    if files.quantization_config is not None:
        raise SystemExit(f"{source} is already quantized; start from the BF16 checkpoint")
    if find_backbone_tensor(files, EMBED_KEYS) is None:
        raise SystemExit(f"{source}: embed_tokens is not in the backbone files (tables already shrunk?). "
                         "Quantize the release checkpoint first, then run clef-shrink-tables on the result.")
    if out.exists():
        raise SystemExit(f"{out} exists; choose a new output folder")
    num_layers = text_config(config)["num_hidden_layers"]
    hybrid_config_groups(num_layers, split)   # validates the split
    t0 = time.perf_counter()
    ids = calibration_ids(data, files.root, num_samples, max_len)
    with atomic_dir(out) as tmp:
        if engine == "llmcompressor":
            quantize_llmcompressor(files.root, tmp, config, split, ids, max_len, fuse_gdn, device)
        else:
            quantize_native(files.root, tmp, config, split, ids, device)
        finalized = finalize_weights(files, tmp)
        write_recipe(tmp / "recipe.yaml", num_layers, split, RECIPE_IGNORE)
        copy_side_files(files, tmp)
        fixes = []
        bad = [g for g in fused_global_scales(tmp) if not g.ok]
        if bad and fix_scales:
            fixes = fix_fused_global_scales(tmp)
        problems = verify_output(tmp, split)
        if problems:
            raise SystemExit("output failed verification:\n  " + "\n  ".join(problems))
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    groups = fused_global_scales(out)
    return {"seconds": time.perf_counter() - t0, "calibration_records": len(ids), "fused_groups": len(groups),
            "dropped_mtp": finalized["dropped_mtp"], "restored_16bit": finalized["restored"],
            "scale_fixes": [f.__dict__ for f in fixes], "schemes": summarize_schemes(scheme_table(out))}


# --------------------------------------------------------------------------- config-only mode


def emit_config_only(source_config: Path | None, out: Path, split: int, head_config: Path | None,
                     marker: str | None) -> list[Path]:
    """Write ``config.json`` (with quantization_config, architecture as after shrink_tables),
    ``recipe.yaml`` and ``clef_head/joint_head_config.json`` (with the version marker) for a
    checkpoint whose weights are built elsewhere. ``source_config=None``: the Clef-Flash release's
    ``config.json`` (:func:`clef_vllm.model.release.clef_flash_config`)."""
    from clef_vllm.model.head import HeadConfig
    from clef_vllm.model.layout import ARCHITECTURE
    from clef_vllm.model.layout import HEAD_CONFIG, HEAD_DIR, MARKER
    from clef_vllm.model.release import RELEASE_HEAD_CONFIG, clef_flash_config
    from clef_vllm.model.repack import default_marker

    config = clef_flash_config() if source_config is None else json.loads(source_config.read_text(encoding="utf-8"))
    num_layers = text_config(config)["num_hidden_layers"]
    ignore = ignore_list(config)
    cfg = dict(config)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["quantization_config"] = quantization_config(config, split, ignore, version="0.19.0")
    written = [write_json(out / "config.json", cfg)]
    write_recipe(out / "recipe.yaml", num_layers, split, RECIPE_IGNORE)
    written.append(out / "recipe.yaml")
    if head_config is not None:
        head = HeadConfig.from_dict(json.loads(head_config.read_text(encoding="utf-8")), str(head_config)).to_dict()
    else:
        hidden = text_config(config)["hidden_size"]
        head = dataclasses.replace(RELEASE_HEAD_CONFIG, hidden_size=hidden).to_dict()   # the release head's shape
    head[MARKER] = marker or default_marker()
    written.append(write_json(out / HEAD_DIR / HEAD_CONFIG, head))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="clef-quantize-mixed", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, help="BF16 checkpoint (release layout)")
    ap.add_argument("--split", type=int, help=f"K: layers < K FP8, >= K NVFP4 (0: all NVFP4; num_layers: all FP8; "
                                                 f"9B Hybrid: {DEFAULT_SPLIT_9B})")
    ap.add_argument("--out", type=Path, required=True, help="output folder (must not exist, except with --emit-config-only)")
    ap.add_argument("--data", help="build_data folder (its train.jsonl) or a JSONL of records; default: synthetic records")
    ap.add_argument("--num-calibration-samples", type=int, default=64)
    ap.add_argument("--max-seq-length", type=int, default=2048)
    ap.add_argument("--engine", choices=("llmcompressor", "native"), default="llmcompressor")
    ap.add_argument("--device", default="cpu", help="calibration (and native export) device, e.g. cuda for the 9B")
    ap.add_argument("--no-fuse-gdn", action="store_true",
                    help="do not patch FUSED_LAYER_NAMES (reproduces the unequal GDN fused scales)")
    ap.add_argument("--fix-scales", action="store_true",
                    help="re-export shards with unequal fused global scales at a shared one instead of failing")
    ap.add_argument("--emit-config-only", action="store_true", help="write config.json, recipe.yaml and the head "
                                                                    "config (from --source-config); no weights")
    ap.add_argument("--source-config", type=Path,
                    help="a BF16 config.json (with --emit-config-only; default: the Clef-Flash release's)")
    ap.add_argument("--head-config", type=Path, help="joint_head_config.json to copy (with --emit-config-only)")
    ap.add_argument("--marker", help="requires_clef_vllm specifier (default: this plugin's minor series)")
    ap.add_argument("--compile", action="store_true",
                    help="let compressed-tensors torch.compile its FP4 helpers (a cold CPU compile takes ~4-5 min; "
                         "by default TORCHDYNAMO_DISABLE=1 runs them eagerly, with bit-identical output)")
    a = ap.parse_args(argv)
    if not a.compile:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")   # before torch is imported
    if a.emit_config_only:
        split = DEFAULT_SPLIT_9B if a.split is None else a.split
        for p in emit_config_only(a.source_config, a.out, split, a.head_config, a.marker):
            print(f"wrote {p}")
        return 0
    if a.source is None or a.split is None:
        ap.error("--source and --split are required")
    from clef_vllm.model.checkpoint import CheckpointError

    try:
        report = run(a.source, a.out, a.split, a.data, a.engine, a.num_calibration_samples, a.max_seq_length,
                     a.fix_scales, not a.no_fuse_gdn, a.device)
    except CheckpointError as exc:
        ap.error(f"--source {exc}")
    print(f"wrote {a.out} in {report['seconds']:.1f} s ({a.engine}, split {a.split}, "
          f"{report['calibration_records']} calibration records)")
    print("  vLLM modules: " + ", ".join(f"{k}={v}" for k, v in sorted(report["schemes"].items())))
    if report["dropped_mtp"] or report["restored_16bit"]:
        print(f"  dropped {report['dropped_mtp']} mtp.* tensor(s); restored {report['restored_16bit']} 16-bit tensor(s) "
              "bit-exactly from the source")
    print(f"  fused NVFP4 groups: {report['fused_groups']}, all sharing one weight global scale"
          + (f" after {len(report['scale_fixes'])} re-exported shard(s)" if report["scale_fixes"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
