"""Build a benchmark checkpoint in seconds: ``tiny`` (real random weights, release or repacked
layout) or ``9b`` (Clef-Flash config and head config, no weights: serve with ``--load-format dummy``).
``--hybrid SPLIT`` gives the 9B folder the Hybrid's compressed-tensors config (layers before SPLIT FP8
W8A8, the rest NVFP4 W4A4, as ``clef-quantize-mixed --split SPLIT`` writes it): serve it with
``--load-format clef-dummy``, whose quantization scales keep the answers finite.

    python3 bench/make_ckpt.py tiny /root/ckpt/tiny [--layout release|repacked]
    python3 bench/make_ckpt.py 9b   /root/ckpt/9b   [--layout repacked|release]
    python3 bench/make_ckpt.py 9b   /root/ckpt/9b-hybrid --hybrid 17
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["tiny", "9b"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", choices=["release", "repacked"], default=None,
                    help="default: release for tiny, repacked for 9b")
    ap.add_argument("--hybrid", type=int, default=None, metavar="SPLIT",
                    help="9b only: the Hybrid's quantization_config, FP8 before layer SPLIT, NVFP4 from it")
    a = ap.parse_args()
    if a.hybrid is not None and a.kind != "9b":
        ap.error("--hybrid is for the 9b kind")
    if a.out.exists():
        print(f"{a.out} exists; leaving it as it is")
        return 0
    if a.kind == "tiny":
        from clef_vllm.model.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(a.out, layout=a.layout or "release")
    else:
        from clef_vllm.model.release import clef_flash_config, write_config_only_checkpoint

        config = None
        if a.hybrid is not None:
            from clef_vllm.quant.recipe import ignore_list, quantization_config

            config = clef_flash_config()
            config["quantization_config"] = quantization_config(config, a.hybrid, ignore_list(config))
        write_config_only_checkpoint(a.out, layout=a.layout or "repacked", config=config)
    hybrid = f", Hybrid split {a.hybrid}" if a.hybrid is not None else ""
    print(f"{a.kind} checkpoint ({a.layout or 'default layout'}{hybrid}) in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
