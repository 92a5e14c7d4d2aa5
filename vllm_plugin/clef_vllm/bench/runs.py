"""One ``clef-bench`` run as a step of a larger CPU measurement (``bench/front_end_ab.py``): run it, read its
single point, and write a measurement's results with the settings that produced them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path


def bench_point(url: str, checkpoint: str, workload: str, concurrency: int, requests: int, out: Path,
                warmup: int = 4) -> dict:
    """One clef-bench run against ``url`` at one concurrency; its single point (clef-bench's JSON)."""
    cmd = ["clef-bench", url, "--tokenizer", checkpoint, "--workload", workload, "-c", str(concurrency),
           "-n", str(requests), "--warmup", str(warmup), "--no-progress", "--time-limit", "600", "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (point,) = json.loads(out.read_text())["points"]
    return point


def save(path: str | None, args: argparse.Namespace, points: list) -> None:
    """The results as JSON (settings, cores, points), when ``path`` is given."""
    if path:
        Path(path).write_text(json.dumps({"settings": vars(args), "cpus": os.cpu_count(), "points": points},
                                         indent=1) + "\n")
