"""The release's processor files as data: what its image (and video) processor reads."""

from __future__ import annotations

import json
from pathlib import Path


def processor_configs() -> dict[str, dict]:
    """The release's processor files (docs/encoding-and-head.md, "Media"): ``Qwen2VLImageProcessor`` (patch 16,
    temporal patch 2, merge 2, mean and std 0.5, bicubic, 65,536 to 16,777,216 pixels) and the video processor."""
    norm = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
            "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2}
    image = {**norm, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
             "size": {"longest_edge": 16777216, "shortest_edge": 65536}}
    video = {**norm, "do_sample_frames": True, "fps": 2, "max_frames": 768, "min_frames": 4,
             "processor_class": "Qwen3VLProcessor", "size": {"longest_edge": 25165824, "shortest_edge": 4096},
             "video_processor_type": "Qwen3VLVideoProcessor"}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            "processor_config.json": {"processor_class": "Qwen3VLProcessor"}}


def write_processor_configs(out: Path) -> None:
    for name, cfg in processor_configs().items():
        (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
