"""Build a benchmark checkpoint in seconds: ``tiny`` (real random weights, release or repacked
layout) or ``9b`` (Clef-Flash config and head config, no weights: serve with ``--load-format dummy``).

    python3 bench/make_ckpt.py tiny /root/ckpt/tiny [--layout release|repacked]
    python3 bench/make_ckpt.py 9b   /root/ckpt/9b   [--layout repacked|release]
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
    a = ap.parse_args()
    if a.out.exists():
        print(f"{a.out} exists; leaving it as it is")
        return 0
    if a.kind == "tiny":
        from clef_vllm.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(a.out, layout=a.layout or "release")
    else:
        from clef_vllm.release import write_config_only_checkpoint

        write_config_only_checkpoint(a.out, layout=a.layout or "repacked")
    print(f"{a.kind} checkpoint ({a.layout or 'default layout'}) in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
