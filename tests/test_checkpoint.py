"""Checkpoint discovery and checks: both layouts, the version marker,
and every broken file named in the error, on copies of the tiny checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_vllm import __version__
from clef_vllm.backends.reference import ReferenceBackend
from clef_vllm.model.checkpoint import (CheckpointError, check_version_marker, load_head, load_head_config,
                                  locate_checkpoint)
from clef_vllm.model.head import JointSchemaHead
from clef_vllm.model.tables import TableError, load_int8_tables

EMBED, LM_HEAD = "model.language_model.embed_tokens.weight", "lm_head.weight"


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def all_keys(files) -> set[str]:
    keys = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2) + "\n")


def refuses(path, *fragments, exc=CheckpointError):
    with pytest.raises(exc) as info:
        ReferenceBackend(path, device="cpu")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


# --------------------------------------------------------------------------- layouts


def test_release_layout(tiny_release):
    files = locate_checkpoint(tiny_release)
    assert files.layout == "release"
    assert files.head_config_file == tiny_release / "joint_head_config.json"
    assert files.head_weights_file == tiny_release / "joint_head.safetensors"
    assert files.tables_file is None
    assert files.index_file == tiny_release / "model.safetensors.index.json"
    index = json.loads(files.index_file.read_text())["weight_map"]
    assert [p.name for p in files.weight_files] == sorted(set(index.values()))
    assert len(files.weight_files) > 1                                     # sharded, like the release
    keys = all_keys(files.weight_files)
    assert keys == set(index)
    assert {EMBED, LM_HEAD} <= keys and any(k.startswith("model.visual.") for k in keys)
    assert any(k.startswith("mtp.") for k in keys)
    config = json.loads((tiny_release / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in config
    assert files.text_config["hidden_size"] == load_head_config(files).hidden_size
    assert not (tiny_release / "clef_head").exists()


def test_repacked_layout(tiny_repacked, tiny_release):
    files = locate_checkpoint(tiny_repacked)
    assert files.layout == "repacked"
    assert files.head_config_file == tiny_repacked / "clef_head" / "joint_head_config.json"
    assert files.head_weights_file == tiny_repacked / "clef_head" / "joint_head.safetensors"
    assert files.tables_file == tiny_repacked / "clef_head" / "tables_int8.safetensors"
    assert not (tiny_repacked / "joint_head.safetensors").exists()
    keys = all_keys(files.weight_files)
    assert EMBED not in keys and LM_HEAD not in keys                      # tables live only in clef_head/
    assert keys == set(json.loads(files.index_file.read_text())["weight_map"])
    assert load_head_config(files).requires_clef_vllm is not None
    # same weights as the release (same seed): every other tensor is identical
    release = locate_checkpoint(tiny_release)
    ref = {k: v for p in release.weight_files for k, v in load_file(str(p)).items()}
    for p in files.weight_files:
        for k, v in load_file(str(p)).items():
            assert torch.equal(v, ref[k]), k
    # int8 tables: one float32 scale per row, close to the bf16 originals
    tables = load_int8_tables(files.tables_file)
    for name, key in (("embed_tokens", EMBED), ("lm_head", LM_HEAD)):
        t = tables[name]
        assert t.weight.dtype == torch.int8 and t.scale.dtype == torch.float32
        assert t.scale.shape == (t.weight.shape[0],) and t.weight.shape == ref[key].shape
        deq, orig = t.dequantize(torch.float32), ref[key].float()
        assert float((deq - orig).norm() / orig.norm()) < 0.01
        assert float((deq - orig).abs().max()) <= float(t.scale.max()) / 2 + 1e-6   # half a step at most
    head_a = load_file(str(files.head_weights_file))
    head_b = load_file(str(release.head_weights_file))
    assert head_a.keys() == head_b.keys() and all(torch.equal(head_a[k], head_b[k]) for k in head_a)


def test_head_loads_strictly_in_both_layouts(tiny_release, tiny_repacked):
    for path in (tiny_release, tiny_repacked):
        files = locate_checkpoint(path)
        head = load_head(files, dtype=torch.float32)
        assert isinstance(head, JointSchemaHead) and head.dtype == torch.float32
        state = load_file(str(files.head_weights_file))
        assert set(head.state_dict()) == set(state)
        for k, v in head.state_dict().items():
            assert torch.equal(v.to(state[k].dtype), state[k])
        assert load_head(files).dtype == torch.bfloat16                   # the default, as the release


# --------------------------------------------------------------------------- version marker


def test_version_marker_refuses_a_newer_checkpoint(tiny_repacked, tmp_path):
    ckpt = copy_of(tiny_repacked, tmp_path)
    cfg = ckpt / "clef_head" / "joint_head_config.json"
    edit_json(cfg, requires_clef_vllm=">=9.0")
    msg = refuses(ckpt, str(cfg), "requires clef-vllm>=9.0", f"clef-vllm {__version__} is installed",
                  "pip install 'clef-vllm>=9.0'")
    with pytest.raises(CheckpointError, match="requires clef-vllm>=9.0"):
        load_head_config(locate_checkpoint(ckpt))
    from clef_vllm import Clef

    with pytest.raises(CheckpointError) as info:
        Clef(ckpt, backend="reference")
    assert str(info.value) == msg


@pytest.mark.parametrize("spec", ["abc", ">=", "==1.0.0.0.0.x", "~=1"])
def test_invalid_version_marker_is_refused(tiny_repacked, tmp_path, spec):
    ckpt = copy_of(tiny_repacked, tmp_path)
    cfg = ckpt / "clef_head" / "joint_head_config.json"
    edit_json(cfg, requires_clef_vllm=spec)
    refuses(ckpt, str(cfg), repr(spec), "is not a PEP 440 version specifier")


def test_version_marker_rules():
    check_version_marker(None, "x")
    check_version_marker(">=0.1,<0.2", "x", version="0.1.0")
    check_version_marker(">=0.1", "x", version="0.2.0rc1")               # pre-releases count
    check_version_marker("==0.1.*", "x", version="0.1.7")
    for spec, version in ((">=0.2", "0.1.0"), ("<0.1", "0.1.0"), ("==0.1.*", "0.2.0")):
        with pytest.raises(CheckpointError, match="requires clef-vllm"):
            check_version_marker(spec, "cfg.json", version=version)


def test_marker_is_also_honoured_in_the_release_layout(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    edit_json(ckpt / "joint_head_config.json", requires_clef_vllm=">=9.0")
    refuses(ckpt, str(ckpt / "joint_head_config.json"), "requires clef-vllm>=9.0")


# --------------------------------------------------------------------------- head config


def test_unknown_head_config_key_is_refused(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    edit_json(ckpt / "joint_head_config.json", temperature=0.7)
    refuses(ckpt, str(ckpt / "joint_head_config.json"), "unknown key(s) ['temperature']")


def test_missing_head_config_key_is_refused(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    cfg = ckpt / "joint_head_config.json"
    data = json.loads(cfg.read_text())
    del data["heads"]
    cfg.write_text(json.dumps(data))
    refuses(ckpt, str(cfg), "missing key(s) ['heads']")


def test_head_hidden_size_must_match_the_backbone(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    edit_json(ckpt / "joint_head_config.json", hidden_size=256)
    refuses(ckpt, str(ckpt / "joint_head_config.json"), "hidden_size 256 does not match the backbone's hidden_size 128")


def test_unreadable_json_is_named(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    (ckpt / "joint_head_config.json").write_text("{not json")
    refuses(ckpt, str(ckpt / "joint_head_config.json"), "unreadable JSON")
    (ckpt / "config.json").write_text("")
    refuses(ckpt, str(ckpt / "config.json"), "unreadable JSON")


# --------------------------------------------------------------------------- missing or corrupt files


def test_not_a_checkpoint(tmp_path):
    refuses(tmp_path / "nowhere", "not a directory")
    (tmp_path / "empty").mkdir()
    refuses(tmp_path / "empty", str(tmp_path / "empty" / "config.json"), "missing")


def test_folder_without_a_head(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    (ckpt / "joint_head.safetensors").unlink()
    (ckpt / "joint_head_config.json").unlink()
    refuses(ckpt, str(ckpt), "no joint head found", "joint_head_config.json", "clef_head/")


@pytest.mark.parametrize("name", ["joint_head.safetensors", "joint_head_config.json"])
def test_one_head_file_missing(tiny_release, tmp_path, name):
    ckpt = copy_of(tiny_release, tmp_path)
    (ckpt / name).unlink()
    refuses(ckpt, f"{ckpt / name}: missing")


def test_head_in_both_places_is_ambiguous(tiny_release, tiny_repacked, tmp_path):
    ckpt = copy_of(tiny_repacked, tmp_path)
    shutil.copy(tiny_release / "joint_head_config.json", ckpt)
    refuses(ckpt, "both at the root and in clef_head/")


def test_missing_shard_listed_in_the_index(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.unlink()
    refuses(ckpt, str(ckpt / "model.safetensors.index.json"), "missing", str(shard))


@pytest.mark.parametrize("cut", [5000, 7, 0])
def test_truncated_backbone_shard(tiny_release, tmp_path, cut):
    ckpt = copy_of(tiny_release, tmp_path)
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:cut])
    refuses(ckpt, str(shard), "unreadable safetensors file")


@pytest.mark.parametrize("cut", [5000, 3])
def test_truncated_head_file(tiny_release, tmp_path, cut):
    ckpt = copy_of(tiny_release, tmp_path)
    head = ckpt / "joint_head.safetensors"
    head.write_bytes(head.read_bytes()[:cut])
    refuses(ckpt, str(head), "unreadable safetensors file")


def _edit_head(ckpt: Path, edit) -> Path:
    path = ckpt / "joint_head.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def test_head_tensor_missing(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    path = _edit_head(ckpt, lambda s: s.pop("layers.1.norm3.bias"))
    refuses(ckpt, str(path), "missing ['layers.1.norm3.bias']")


def test_head_tensor_unexpected(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    path = _edit_head(ckpt, lambda s: s.__setitem__("layers.9.norm1.weight", torch.zeros(64, dtype=torch.bfloat16)))
    refuses(ckpt, str(path), "unexpected ['layers.9.norm1.weight']")


def test_head_tensor_wrong_shape(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    path = _edit_head(ckpt, lambda s: s.__setitem__("type_embedding.weight", torch.zeros(4, 64, dtype=torch.bfloat16)))
    refuses(ckpt, str(path), "type_embedding.weight has shape (4, 64), expected (3, 64)")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_head_tensor_not_finite(tiny_release, tmp_path, value):
    ckpt = copy_of(tiny_release, tmp_path)

    def poison(s):
        s["residual_scorer.0.weight"][3, 5] = value

    path = _edit_head(ckpt, poison)
    refuses(ckpt, str(path), "residual_scorer.0.weight has non-finite values")


def test_backbone_tensor_not_finite_or_missing(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.language_model.layers.0.mlp.up_proj.weight"
    shard = ckpt / index[key]
    state = load_file(str(shard))
    state[key][0, 0] = float("nan")
    save_file(state, str(shard), metadata={"format": "pt"})
    refuses(ckpt, "layers.0.mlp.up_proj.weight has non-finite values")
    del state[key]
    save_file(state, str(shard), metadata={"format": "pt"})
    refuses(ckpt, "backbone tensors do not match config.json", "layers.0.mlp.up_proj.weight")


def test_release_without_lm_head(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt / index["weight_map"].pop(LM_HEAD)
    state = load_file(str(shard))
    del state[LM_HEAD]
    save_file(state, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    refuses(ckpt, "lm_head.weight not found", "tables_int8.safetensors")


def test_truncated_int8_tables(tiny_repacked, tmp_path):
    ckpt = copy_of(tiny_repacked, tmp_path)
    tables = ckpt / "clef_head" / "tables_int8.safetensors"
    tables.write_bytes(tables.read_bytes()[:1000])
    refuses(ckpt, str(tables), "unreadable safetensors file", exc=(CheckpointError, TableError))


@pytest.mark.parametrize("edit, fragment", [
    (lambda s: s.pop("lm_head.scale"), "missing tensor(s) ['lm_head.scale']"),
    (lambda s: s.__setitem__("embed_tokens.weight", s["embed_tokens.weight"].float()), "must be a 2-D int8 tensor"),
    (lambda s: s.__setitem__("lm_head.scale", s["lm_head.scale"][:-1]), "one float scale per row"),
    (lambda s: s["lm_head.scale"].__setitem__(0, float("nan")), "non-finite or non-positive scales"),
    (lambda s: s["embed_tokens.scale"].__setitem__(1, 0.0), "non-finite or non-positive scales"),
])
def test_bad_int8_tables(tiny_repacked, tmp_path, edit, fragment):
    ckpt = copy_of(tiny_repacked, tmp_path)
    path = ckpt / "clef_head" / "tables_int8.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))
    refuses(ckpt, str(path), fragment, exc=(CheckpointError, TableError))


def test_tables_in_both_places_are_refused(tiny_repacked, tiny_release, tmp_path):
    ckpt = copy_of(tiny_repacked, tmp_path)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    extra = ckpt / "model-extra.safetensors"
    lm = load_file(str(tiny_release / json.loads((tiny_release / "model.safetensors.index.json").read_text())
                        ["weight_map"][LM_HEAD]))[LM_HEAD]
    save_file({LM_HEAD: lm}, str(extra), metadata={"format": "pt"})
    index["weight_map"][LM_HEAD] = extra.name
    index_path.write_text(json.dumps(index))
    refuses(ckpt, "both in the backbone files and in", "tables_int8.safetensors")


def test_broken_tokenizer_is_named(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    refuses(ckpt, str(ckpt), "cannot load the tokenizer")


def test_quantized_backbone_is_refused_by_the_reference_backend(tiny_release, tmp_path):
    ckpt = copy_of(tiny_release, tmp_path)
    edit_json(ckpt / "config.json", quantization_config={"quant_method": "compressed-tensors"})
    refuses(ckpt, str(ckpt / "config.json"), "quantized backbone (compressed-tensors)", "--backend vllm")


def test_unsharded_checkpoint_in_both_layouts(tmp_path, cache_dir):
    """One ``model.safetensors`` without an index: the root's joint_head.safetensors is not a backbone file."""
    from clef_vllm import Clef
    from clef_vllm.model.repack import repack_tables
    from clef_vllm.model.tiny import build_tiny_checkpoint

    single = build_tiny_checkpoint(tmp_path / "single", shard_mb=100)
    files = locate_checkpoint(single)
    assert files.index_file is None
    assert [p.name for p in files.weight_files] == ["model.safetensors"]
    repacked = tmp_path / "single-repacked"
    repack_tables(single, repacked)
    files = locate_checkpoint(repacked)
    assert files.layout == "repacked" and [p.name for p in files.weight_files] == ["model.safetensors"]
    assert not (repacked / "joint_head.safetensors").exists()
    request = {"model": "m", "state": "Checkout is down.", "questions": {"q": {"type": "noul", "instructions": "Ok?"}}}
    answers = []
    for path in (single, repacked):
        with Clef(path, backend="reference") as clef:
            answers.append(clef.systemone(request)["answers"]["q"]["noul"])
    assert abs(answers[0] - answers[1]) <= 1e-2
