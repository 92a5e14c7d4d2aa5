"""Repack a checkpoint: embed_tokens and lm_head -> ``clef_head/tables_int8.safetensors``.

Used by ``clef-shrink-tables`` and by the tiny-checkpoint builder. The output is written to a
temporary sibling folder and renamed into place at the end (:mod:`clef_vllm.util.atomic`), so an
interrupted run never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_vllm.model.checkpoint import locate_checkpoint
from clef_vllm.model.layout import ARCHITECTURE
from clef_vllm.model.layout import EMBED_KEYS, HEAD_CONFIG, HEAD_DIR, HEAD_WEIGHTS, INDEX, LM_HEAD_KEYS, MARKER, TABLES
from clef_vllm.model.tables import quantize_rows, table_keys
from clef_vllm.util.atomic import atomic_dir, save_safetensors, write_json
from clef_vllm.version import __version__


def default_marker(version: str = __version__) -> str:
    """``>=X.Y,<X.(Y+1)``: the minor series this plugin belongs to."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return f">={major}.{minor},<{major}.{minor + 1}"


@dataclass
class TableReport:
    name: str
    rows: int
    width: int
    relative_error: float     # ||W - deq(q)|| / ||W||
    mean_row_cosine: float


def table_report(name: str, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> TableReport:
    w = weight.float()
    deq = q.float() * scale[:, None]
    rel = float((w - deq).norm() / w.norm().clamp_min(1e-30))
    cos = torch.nn.functional.cosine_similarity(w, deq, dim=1, eps=1e-12)
    return TableReport(name, w.shape[0], w.shape[1], rel, float(cos.mean()))


def repack_tables(src: str | Path, dst: str | Path, marker: str | None = None,
                  architecture: str | None = ARCHITECTURE, progress=None) -> list[TableReport]:
    """Write a repacked copy of ``src`` at ``dst`` (must not exist, or be a previous repack when
    ``src == dst``). Returns the quantization report of both tables."""
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    files = locate_checkpoint(src)
    if files.layout == "repacked" and files.tables_file is not None:
        raise FileExistsError(f"{src} is already repacked ({files.tables_file} exists)")
    if dst.exists() and dst.resolve() != src.resolve():
        raise FileExistsError(f"{dst} exists; choose a new output folder")
    with atomic_dir(dst, replace=True) as tmp:
        (tmp / HEAD_DIR).mkdir()
        tables, reports = {}, []
        weight_map, table_names = {}, {}
        for path in files.weight_files:
            kept = {}
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in EMBED_KEYS or key in LM_HEAD_KEYS:
                        name = "embed_tokens" if key in EMBED_KEYS else "lm_head"
                        table_names[name] = key
                        weight = f.get_tensor(key)
                        q, scale = quantize_rows(weight)
                        wk, sk = table_keys(name)
                        tables[wk], tables[sk] = q, scale
                        reports.append(table_report(name, weight, q, scale))
                    else:
                        kept[key] = f.get_tensor(key)
            save_safetensors(kept, tmp / path.name)
            weight_map.update({k: path.name for k in kept})
            if progress is not None:
                progress(path.name)
        missing = sorted({"embed_tokens", "lm_head"} - set(table_names))
        if missing:
            raise ValueError(f"{src}: no {missing} tensor found in the backbone files")
        save_safetensors(tables, tmp / HEAD_DIR / TABLES)
        if files.index_file is not None:
            index = json.loads(files.index_file.read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            total = 0
            for name in set(weight_map.values()):
                with safe_open(str(tmp / name), framework="pt") as f:
                    for key in f.keys():
                        t = f.get_slice(key)
                        total += _numel(t.get_shape()) * _dtype_size(t.get_dtype())
            index.setdefault("metadata", {})["total_size"] = total
            write_json(tmp / INDEX, index)

        head_cfg = json.loads(files.head_config_file.read_text())
        head_cfg[MARKER] = marker or default_marker()
        write_json(tmp / HEAD_DIR / HEAD_CONFIG, head_cfg)
        shutil.copy2(files.head_weights_file, tmp / HEAD_DIR / HEAD_WEIGHTS)

        config = dict(files.config)
        if architecture:
            config["architectures"] = [architecture]
        write_json(tmp / "config.json", config)
        skip = {p.name for p in files.weight_files} | {INDEX, "config.json", HEAD_CONFIG, HEAD_WEIGHTS, HEAD_DIR}
        for item in src.iterdir():
            if item.name in skip or item.name.startswith("."):
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
    return reports


def set_marker(path: str | Path, marker: str | None = None) -> str:
    """Write ``requires_clef_vllm`` into a repacked checkpoint's head config (atomic rename);
    returns the marker. Used when a repacked checkpoint is repacked again."""
    files = locate_checkpoint(path)
    if files.layout != "repacked":
        raise ValueError(f"{path}: not a repacked checkpoint (no {HEAD_DIR}/)")
    head_cfg = json.loads(files.head_config_file.read_text())
    head_cfg[MARKER] = marker or head_cfg.get(MARKER) or default_marker()
    write_json(files.head_config_file, head_cfg)
    return head_cfg[MARKER]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _dtype_size(name: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8,
            "BOOL": 1, "I16": 2}.get(name, 2)
