"""A tiny Hybrid checkpoint made by the tools' own pipeline with the native exporter (seconds on a CPU): synthetic
records (``clef_vllm.tools.build_data``), FP8 W8A8 layers below ``split`` and NVFP4 W4A4 from it
(``clef_vllm.tools.quantize_mixed --engine native``), int8 tables (``clef_vllm.tools.shrink_tables``). The CPU
tests load it through vLLM; ``tests/gpu/fast_paths.py --only nvfp4`` serves it on the GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def build_tiny_hybrid(source: str | Path, work: str | Path, *, split: int = 2) -> Path:
    """The Hybrid of the tiny BF16 release checkpoint ``source``, built under ``work``; returns its folder."""
    work = Path(work)

    def run(tool: str, *args) -> None:
        subprocess.run([sys.executable, "-m", f"clef_vllm.tools.{tool}", *map(str, args)], check=True,
                       capture_output=True, text=True)

    run("build_data", "--out", work / "data", "--synthetic", "--synthetic-count", 60)
    run("quantize_mixed", "--source", source, "--split", split, "--data", work / "data", "--out", work / "q",
        "--engine", "native", "--num-calibration-samples", 8, "--device", "cpu")
    run("shrink_tables", work / "q", "--out", work / "hybrid")
    return work / "hybrid"
