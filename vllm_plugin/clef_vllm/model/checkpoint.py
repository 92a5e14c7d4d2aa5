"""Find and check the parts of a Clef checkpoint, in both layouts.

* **release** (Cloudflare/clef-flash): ``joint_head.safetensors`` + ``joint_head_config.json`` at
  the root, sharded bf16 backbone with ``model.safetensors.index.json``, ``lm_head.weight`` and
  ``model.language_model.embed_tokens.weight`` inside the shards.
* **repacked** (quantized builds): ``clef_head/joint_head.safetensors``,
  ``clef_head/joint_head_config.json`` (with the ``requires_clef_vllm`` marker) and
  ``clef_head/tables_int8.safetensors`` (embed_tokens and lm_head as int8 + one scale per row);
  neither table is in the backbone file(s).

Every loader of the package (reference backend, vLLM model, tools) goes through here; the file
and tensor names themselves are in :mod:`clef_vllm.model.layout`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from clef_vllm.model.head import HeadConfig, HeadConfigError, JointSchemaHead
from clef_vllm.model.layout import (EMBED_KEYS, HEAD_CONFIG, HEAD_DIR, HEAD_WEIGHTS, INDEX, LM_HEAD_KEYS, MARKER, TABLES,
                              backbone_prefix, text_config)
from clef_vllm.version import __version__

__all__ = ["EMBED_KEYS", "HEAD_CONFIG", "HEAD_DIR", "HEAD_WEIGHTS", "INDEX", "LM_HEAD_KEYS", "MARKER", "TABLES",
           "CheckpointError", "CheckpointFiles", "locate_checkpoint", "load_head_config", "load_head_state",
           "load_head", "iter_backbone_tensors", "find_backbone_tensor", "check_version_marker", "check_finite"]


class CheckpointError(RuntimeError):
    """The checkpoint cannot be served; the message names the file and the fix."""


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each part of a checkpoint lives."""

    root: Path
    layout: str                      # "release" | "repacked"
    config: dict                     # config.json
    head_config_file: Path
    head_weights_file: Path
    tables_file: Path | None         # repacked layout only
    weight_files: tuple[Path, ...]   # backbone safetensors
    index_file: Path | None

    @property
    def text_config(self) -> dict:
        """The text model's config (``text_config`` of a VL config, else the config itself)."""
        return text_config(self.config)

    @property
    def backbone_prefix(self) -> str:
        """``model.language_model.`` (VL-shaped config, the release) or ``model.`` (text-only)."""
        return backbone_prefix(self.config)

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    @property
    def has_vision(self) -> bool:
        """Whether the checkpoint can see: a vision tower in its config and the release's image processor
        (``preprocessor_config.json``) beside it."""
        return isinstance(self.config.get("vision_config"), dict) and (self.root / "preprocessor_config.json").is_file()

    @property
    def has_video(self) -> bool:
        """Whether it can see videos too: the release's video processor (``video_preprocessor_config.json``)."""
        return self.has_vision and (self.root / "video_preprocessor_config.json").is_file()


def locate_checkpoint(path: str | Path, require_weights: bool = True) -> CheckpointFiles:
    """Find every part of the checkpoint at ``path``; raise CheckpointError naming what is missing.

    ``require_weights=False`` accepts a folder without backbone/head weights (vLLM's
    ``load_format="dummy"`` benchmarks need only the configs)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected a Clef checkpoint folder)")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing; a Clef checkpoint needs its backbone config.json")
    config = _read_json(config_file)

    at_root = (root / HEAD_CONFIG).is_file() or (root / HEAD_WEIGHTS).is_file()
    in_dir = (root / HEAD_DIR / HEAD_CONFIG).is_file() or (root / HEAD_DIR / HEAD_WEIGHTS).is_file()
    if at_root and in_dir:
        raise CheckpointError(f"{root}: head files exist both at the root and in {HEAD_DIR}/; keep one layout")
    if not (at_root or in_dir):
        raise CheckpointError(f"{root}: no joint head found (expected {HEAD_CONFIG} + {HEAD_WEIGHTS} at the root "
                              f"or in {HEAD_DIR}/)")
    head_dir = root / HEAD_DIR if in_dir else root
    for name in (HEAD_CONFIG, HEAD_WEIGHTS) if require_weights else (HEAD_CONFIG,):
        if not (head_dir / name).is_file():
            raise CheckpointError(f"{head_dir / name}: missing")
    tables = head_dir / TABLES if in_dir and (head_dir / TABLES).is_file() else None

    index_file = root / INDEX if (root / INDEX).is_file() else None
    if index_file is not None:
        names = sorted(set(_read_json(index_file).get("weight_map", {}).values()))
        weight_files = tuple(root / n for n in names)
        missing = [str(p) for p in weight_files if not p.is_file()]
        if missing and require_weights:
            raise CheckpointError(f"{index_file}: lists shard(s) that are missing: {missing}")
    else:  # a single unsharded file: everything at the root except the head's own files
        weight_files = tuple(p for p in sorted(root.glob("*.safetensors")) if p.name not in (HEAD_WEIGHTS, TABLES))
    if not weight_files and require_weights:
        raise CheckpointError(f"{root}: no backbone *.safetensors found")
    return CheckpointFiles(root, "repacked" if in_dir else "release", config, head_dir / HEAD_CONFIG,
                           head_dir / HEAD_WEIGHTS, tables, weight_files, index_file)


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; anything else is a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_version_marker(spec: str | None, source: str | Path, version: str = __version__) -> None:
    """Refuse a checkpoint whose ``requires_clef_vllm`` PEP 440 specifier excludes this plugin."""
    if spec is None:
        return
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        wanted = SpecifierSet(spec)
    except InvalidSpecifier:
        raise CheckpointError(f"{source}: {MARKER}={spec!r} is not a PEP 440 version specifier") from None
    if not wanted.contains(version, prereleases=True):
        raise CheckpointError(
            f"{source}: this checkpoint requires clef-vllm{spec}, but clef-vllm {version} is installed. "
            f"Install a matching plugin (pip install 'clef-vllm{spec}') or use a checkpoint built for {version}.")


def load_head_config(files: CheckpointFiles) -> HeadConfig:
    """Parse the head config (unknown keys are an error) and check the version marker."""
    try:
        cfg = HeadConfig.from_dict(_read_json(files.head_config_file), source=str(files.head_config_file))
    except HeadConfigError as exc:
        raise CheckpointError(str(exc)) from None
    check_version_marker(cfg.requires_clef_vllm, files.head_config_file)
    hidden = files.text_config.get("hidden_size")
    if hidden is not None and hidden != cfg.hidden_size:
        raise CheckpointError(f"{files.head_config_file}: hidden_size {cfg.hidden_size} does not match the "
                              f"backbone's hidden_size {hidden}")
    return cfg


def check_finite(name: str, tensor: torch.Tensor, source) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{source}: tensor {name} has non-finite values")


def load_head_state(files: CheckpointFiles, config: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's state dict, checked: exact tensor names and shapes, finite values."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(files.head_weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types on corrupt files
        raise CheckpointError(f"{files.head_weights_file}: unreadable safetensors file ({exc})") from None
    with torch.device("meta"):
        expected = {k: v.shape for k, v in JointSchemaHead(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{files.head_weights_file}: head tensors do not match {files.head_config_file.name}: "
                              f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{files.head_weights_file}: {name} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(expected[name])}")
        check_finite(name, tensor, files.head_weights_file)
    return state


def load_head(files: CheckpointFiles, dtype=torch.bfloat16, device="cpu") -> JointSchemaHead:
    """The joint head in ``dtype`` on ``device`` (strict load)."""
    config = load_head_config(files)
    state = load_head_state(files, config)
    head = JointSchemaHead(config)
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def iter_backbone_tensors(files: CheckpointFiles, device="cpu",
                          check_values: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the backbone file(s), with its checkpoint name. ``check_values`` refuses a
    non-finite floating-point tensor, naming the shard that holds it."""
    from safetensors import safe_open

    for path in files.weight_files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    if check_values:
                        check_finite(key, tensor, path)
                    yield key, tensor
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types on corrupt files
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def find_backbone_tensor(files: CheckpointFiles, candidates: tuple[str, ...], device="cpu") -> torch.Tensor | None:
    """One tensor by name (first of ``candidates`` present), reading only the shard that holds it."""
    from safetensors import safe_open

    weight_map = _read_json(files.index_file)["weight_map"] if files.index_file else None
    for key in candidates:
        paths = [files.root / weight_map[key]] if weight_map is not None and key in weight_map else (
            [] if weight_map is not None else list(files.weight_files))
        for path in paths:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                if key in f.keys():
                    return f.get_tensor(key)
    return None
