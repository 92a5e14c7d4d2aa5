"""``clef-shrink-tables``: move embed_tokens and lm_head out of the backbone into ``clef_head/tables_int8.safetensors``.

Both tables become int8 with one float32 scale per row (``row ≈ q · scale``); the joint head
moves to ``clef_head/``; ``requires_clef_vllm`` is written into its config; ``config.json`` gets
the plugin's architecture. Works on BF16 and quantized (compressed-tensors) checkpoints alike:
every other tensor is copied as it is. Uses ``clef_vllm.model.repack.repack_tables``: the result is
built in a temporary sibling folder and renamed into place, so an interrupted run never leaves a
half-written checkpoint. Running it again on a repacked checkpoint only refreshes the marker.

    clef-shrink-tables CKPT                  # in place
    clef-shrink-tables CKPT --out CKPT-int8  # to a new folder
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def shrink(src: Path, out: Path | None, marker: str | None, keep_architecture: bool) -> dict:
    """Repack ``src`` (into ``out`` or in place). Returns what happened, for printing and tests."""
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.model.layout import ARCHITECTURE
    from clef_vllm.model.repack import repack_tables, set_marker

    files = locate_checkpoint(src)
    if files.layout == "repacked" and files.tables_file is not None:
        if out is not None and out.resolve() != src.resolve():
            raise SystemExit(f"{src} is already repacked; nothing to write to {out}")
        return {"already": True, "marker": set_marker(src, marker), "tables": [], "dst": src}
    dst = out or src
    t0 = time.perf_counter()
    reports = repack_tables(src, dst, marker=marker, architecture=None if keep_architecture else ARCHITECTURE)
    final = locate_checkpoint(dst)
    head = json.loads(final.head_config_file.read_text())
    return {"already": False, "marker": head.get("requires_clef_vllm"), "tables": reports, "dst": dst,
            "seconds": time.perf_counter() - t0, "quantized": final.quantization_config is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="clef-shrink-tables", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, help="write here instead of in place (must not exist)")
    ap.add_argument("--marker", help="requires_clef_vllm PEP 440 specifier (default: this plugin's minor series)")
    ap.add_argument("--keep-architecture", action="store_true", help="leave config.json's architectures unchanged")
    a = ap.parse_args(argv)
    from clef_vllm.model.checkpoint import CheckpointError

    try:
        r = shrink(a.checkpoint, a.out, a.marker, a.keep_architecture)
    except CheckpointError as exc:
        ap.error(str(exc))
    if r["already"]:
        print(f"{a.checkpoint} is already repacked; requires_clef_vllm: {r['marker']}")
        return 0
    for t in sorted(r["tables"], key=lambda t: t.name):
        print(f"{t.name:13s} {t.rows} x {t.width}  int8 + fp32 row scales  relative error {100 * t.relative_error:.3f} %"
              f"  mean row cosine {t.mean_row_cosine:.6f}")
    print(f"requires_clef_vllm: {r['marker']}")
    where = "in place" if r["dst"] == a.checkpoint else f"to {r['dst']}"
    print(f"wrote {r['dst']} ({where}, {'quantized' if r['quantized'] else '16-bit'} backbone) in {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
