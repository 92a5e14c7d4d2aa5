"""Request records: the JSONL format of build_data's datasets and of every request file the tools read.

One JSON object per line: a complete SystemOne request body plus bookkeeping keys of ours::

    {"model": "clef-flash", "state": "...", "questions": {"label": {"type": "choice", ...}},
     "answer": {"label": "entailment"}, "source": "evals/corr2cause", "id": "3f1c…"}

``answer`` maps each question id to the correct option id (``"true"``/``"false"`` for noul, the
level index as a string for score); ``source`` names the dataset; ``id`` is a content hash. A
record may also wrap its body as ``{"request": {...}, ...}``. The reference dialect ignores the
bookkeeping keys (and names them in the response's ``warnings``), so a record can be sent as it is;
:func:`request_body` keeps the request keys only (for strict clients). ``clef-build-data`` writes records; the quantization tools calibrate on
them; ``clef-bench`` / ``clef-parity`` replay them. All of them read them here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: Top-level keys of a SystemOne request; anything else in a record is bookkeeping.
REQUEST_KEYS = ("model", "state", "questions", "images", "videos")
DEFAULT_MODEL = "clef-flash"


@dataclass
class RequestRecord:
    """A record as the tools use it: the SystemOne body, a label (the record's ``id`` or its line),
    the correct option id per question when the record has them, and its source dataset."""

    body: dict
    label: str
    answer: dict | None = None
    source: str | None = None


def request_body(record: dict, default_model: str | None = DEFAULT_MODEL) -> dict:
    """The SystemOne body of a record: its request keys only (a ``{"request": {...}}`` wrapper is
    unwrapped); ``model`` defaults to ``default_model`` when the record has none."""
    if isinstance(record.get("request"), dict) and "questions" not in record:
        record = record["request"]
    body = {k: record[k] for k in REQUEST_KEYS if k in record}
    if default_model is not None:
        body.setdefault("model", default_model)
    return body


def record_id(body: dict) -> str:
    """A record's id: a short hash of its request body's content."""
    return hashlib.sha1(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def records_path(path: str | Path, split: str = "train") -> Path:
    """``path`` itself for a file; ``path/{split}.jsonl`` for a build_data folder."""
    path = Path(path)
    return path / f"{split}.jsonl" if path.is_dir() else path


def iter_records(path: str | Path, split: str = "train") -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for every non-empty line; a line that is not a JSON object is a
    ValueError naming ``file:line``."""
    path = records_path(path, split)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: a record must be a JSON object")
            yield lineno, record


def read_records(path: str | Path, limit: int | None = None, split: str = "train") -> list[dict]:
    """The records (dicts, as written) of a JSONL file, or of ``DIR/{split}.jsonl`` for a build_data folder."""
    out = []
    for _, record in iter_records(path, split):
        out.append(record)
        if limit and len(out) >= limit:
            break
    return out


def load_request_file(path: str | Path, limit: int | None = None, default_model: str = DEFAULT_MODEL,
                      split: str = "train") -> list[RequestRecord]:
    """The records of a JSONL file (or build_data folder) as :class:`RequestRecord` s."""
    out: list[RequestRecord] = []
    for lineno, record in iter_records(path, split):
        answer = record.get("answer") if isinstance(record.get("answer"), dict) else None
        source = record.get("source") if isinstance(record.get("source"), str) else None
        out.append(RequestRecord(request_body(record, default_model), str(record.get("id", f"line{lineno}")),
                                 answer, source))
        if limit is not None and len(out) >= limit:
            break
    return out


def dump_record(record: dict) -> str:
    """One JSONL line (no trailing newline), non-ASCII kept as is."""
    return json.dumps(record, ensure_ascii=False)
