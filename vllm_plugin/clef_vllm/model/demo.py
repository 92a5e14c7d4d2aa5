"""The demo checkpoint: what ``clef-systemone``, ``Clef()`` and the tools serve for ``demo``.

A tiny random Clef in the release layout (:mod:`clef_vllm.model.tiny`), built on first use under
``$CLEF_VLLM_CACHE`` (default ``~/.cache/clef-vllm``). Its answers are random-weight answers: it
shows the protocol and the serving path, not quality. The name ``demo`` never reaches a model hub.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from clef_vllm.version import __version__

DEMO = "demo"


def cache_root() -> Path:
    """``$CLEF_VLLM_CACHE``, else ``~/.cache/clef-vllm``: where generated checkpoints and tokenizers go."""
    return Path(os.environ.get("CLEF_VLLM_CACHE") or Path.home() / ".cache" / "clef-vllm")


#: Files of the demo folder the current builder writes (one missing: the folder is rebuilt).
DEMO_FILES = ("joint_head.safetensors", "preprocessor_config.json")


def demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The demo checkpoint's folder, built (a few seconds) when it is not there yet."""
    from clef_vllm.model.tiny import build_tiny_checkpoint

    path = Path(cache_dir or cache_root()) / f"demo-tiny-{__version__}"
    if not all((path / name).is_file() for name in DEMO_FILES):    # absent, or built by a release without them
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        try:
            build_tiny_checkpoint(path)
        except OSError:            # another process built it meanwhile (servers started at once): take theirs
            if not all((path / name).is_file() for name in DEMO_FILES):
                raise
    return path


def is_demo(model_dir: str | Path | None) -> bool:
    return model_dir is None or str(model_dir) == DEMO


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """``None`` or ``"demo"`` -> the demo checkpoint's folder (logged); anything else -> that folder."""
    if not is_demo(model_dir):
        return Path(model_dir).expanduser()
    path = demo_checkpoint()
    logging.getLogger("clef_vllm").info(describe_demo(path))
    return path


def describe_demo(path: Path) -> str:
    """One line saying where the demo checkpoint lives (the tools print it)."""
    return f"demo checkpoint (tiny, random weights): {path}"
