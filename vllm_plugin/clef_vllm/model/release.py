"""The Cloudflare/clef-flash release configs (config.json and joint_head_config.json) as data, and 9B-shaped
checkpoint folders with configs only (for vLLM's ``load_format="dummy"``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from clef_vllm.model.head import HeadConfig
from clef_vllm.model.processor_config import write_processor_configs

#: joint_head_config.json of the release.
RELEASE_HEAD_CONFIG = HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)


def clef_flash_config() -> dict:
    """config.json of Cloudflare/clef-flash @ 17f0b0a (Qwen3.5-9B with the release's changes)."""
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "layer_types": layer_types, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 0, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16, "num_hidden_layers": 32, "num_key_value_heads": 4, "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    }
    vision = {
        "deepstack_visual_indexes": [], "depth": 27, "dtype": "bfloat16", "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
        "model_type": "qwen3_5_vision", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": "bfloat16", "image_token_id": 248056,
        "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False,
        "transformers_version": "5.10.2", "video_token_id": 248057, "vision_config": vision,
        "vision_end_token_id": 248054, "vision_start_token_id": 248053,
    }


def write_config_only_checkpoint(out: str | Path, tokenizer_dir: str | Path | None = None, *, layout: str = "release",
                                 marker: str | None = None, config: dict | None = None) -> Path:
    """A 9B-shaped folder with configs and a tokenizer but no weights (``load_format="dummy"``).

    ``tokenizer_dir`` may hold any tokenizer whose ids fit the 248,320-row vocabulary (a tiny one
    is fine for throughput work: token counts are what matter); ``None`` writes the tiny test
    tokenizer (:func:`clef_vllm.model.tiny.build_tokenizer`).
    """
    from clef_vllm.model.layout import ARCHITECTURE
    from clef_vllm.model.repack import default_marker

    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    cfg = dict(config or clef_flash_config())
    head = RELEASE_HEAD_CONFIG.to_dict()
    if layout == "repacked":
        cfg["architectures"] = [ARCHITECTURE]
        head["requires_clef_vllm"] = marker or default_marker()
        (out / "clef_head").mkdir()
        head_path = out / "clef_head" / "joint_head_config.json"
    else:
        head_path = out / "joint_head_config.json"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    head_path.write_text(json.dumps(head, indent=2) + "\n")
    write_processor_configs(out)
    if tokenizer_dir is None:
        from clef_vllm.model.tiny import build_tokenizer

        build_tokenizer(out)
        return out
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
