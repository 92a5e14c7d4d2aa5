"""Write files and folders so that a crash never leaves a half-written one behind.

Everything the package and its tools write to a checkpoint, a data folder or a cache goes
through here: the content is written under a temporary name in the same folder (same file
system), then renamed into place with ``os.replace`` (atomic on POSIX). On an exception the
temporary is removed and the target is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path of ``path``; on success it replaces ``path``.

    >>> with atomic_file("out/config.json") as tmp:
    ...     tmp.write_text("{}")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if path.exists():
            tmp.chmod(path.stat().st_mode & 0o777)
        else:
            tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling folder of ``path``; on success it becomes ``path``.

    ``path`` must not exist unless ``replace``: then the old folder is swapped out only after
    the new one is complete, and put back if the final rename fails (``path`` is never missing).
    """
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"{path} exists; choose a new output folder")
    parent = path.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if path.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=parent))
            backup.rmdir()
            os.replace(path, backup)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(backup, path)
                raise
            shutil.rmtree(backup)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (with a trailing newline) to ``path`` atomically."""
    return write_text(path, json.dumps(data, indent=indent) + "\n")


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> Path:
    """``safetensors.torch.save_file`` (contiguous tensors, ``{"format": "pt"}`` by default), atomically."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=metadata if metadata is not None else {"format": "pt"})
    return Path(path)
