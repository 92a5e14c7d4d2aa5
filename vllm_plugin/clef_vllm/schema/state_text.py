"""A state's rendered text: a string as is, anything else as compact JSON with sorted keys, written only as far
as it is read (the encoder tokenizes a long state's head only)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any


def render(value: Any) -> str:
    """A string verbatim; anything else as compact JSON with sorted keys and non-ASCII kept.

    Python's ``json`` prints floats with ``repr`` (``1250.0`` stays ``1250.0``), as the reference.
    """
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_STRING_CHUNK = 65536
_INF = float("inf")


def _scalar_text(node: Any) -> str | None:
    """JSON text of a scalar exactly as ``json.dumps`` writes it (``None`` for containers)."""
    if node is None:
        return "null"
    if node is True:
        return "true"
    if node is False:
        return "false"
    if isinstance(node, int):
        return int.__repr__(node)
    if isinstance(node, float):
        if node != node:
            return "NaN"
        if node in (_INF, -_INF):
            return "Infinity" if node > 0 else "-Infinity"
        return float.__repr__(node)
    return None


class StateText:
    """The state's rendered text (``render(state)``), produced only as far as it is read.

    A string state is used as is. Any other state is written piece by piece with an explicit stack (no recursion),
    exactly as ``json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` would write it;
    long strings are escaped a chunk at a time."""

    def __init__(self, state: Any):
        self._size = len(state) if isinstance(state, str) else 0
        self._parts: list[str] = [state] if isinstance(state, str) else []
        self._text: str | None = state if isinstance(state, str) else None
        # frames: [closing text, items, next index, is_dict] or [None, string, next offset, False]
        self._stack: list[list] = []
        if not isinstance(state, str):
            self._emit("", state)

    @property
    def complete(self) -> bool:
        return not self._stack

    def _emit(self, prefix: str, node: Any) -> None:
        """Write ``prefix`` and the start of ``node``; push what is left of it."""
        text = _scalar_text(node)
        if text is None and isinstance(node, str):
            if len(node) <= _STRING_CHUNK:
                text = encode_basestring(node)
            else:
                text = '"'
                self._stack.append([None, node, 0, False])
        elif text is None and isinstance(node, (list, tuple)):
            text = "[" if node else "[]"
            if node:
                self._stack.append(["]", node, 0, False])
        elif text is None and isinstance(node, dict) and all(type(k) is str for k in node):
            text = "{" if node else "{}"
            if node:
                self._stack.append(["}", sorted(node.items(), key=lambda kv: kv[0]), 0, True])
        elif text is None:                          # other keys or types (offline API): json decides
            text = json.dumps(node, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        self._add(prefix + text)

    def _add(self, piece: str) -> None:
        self._parts.append(piece)
        self._size += len(piece)
        self._text = None

    def _step(self) -> None:
        frame = self._stack[-1]
        close, items, i, is_dict = frame
        if close is None:                           # inside a long string
            chunk = items[i:i + _STRING_CHUNK]
            frame[2] = i + len(chunk)
            self._add(encode_basestring(chunk)[1:-1])
            if frame[2] >= len(items):
                self._stack.pop()
                self._add('"')
            return
        if i == len(items):
            self._stack.pop()
            self._add(close)
            return
        frame[2] = i + 1
        sep = "," if i else ""
        if is_dict:
            key, item = items[i]
            self._emit(sep + encode_basestring(key) + ":", item)
        else:
            self._emit(sep, items[i])

    def upto(self, n: int) -> str:
        """The first ``n`` characters or more (everything rendered so far), or all of it if shorter."""
        while self._stack and self._size < n:
            self._step()
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text

    def remaining_chars(self, after: int) -> int:
        """How many characters follow position ``after``: what is rendered beyond it, plus the length
        of what is not rendered yet (``json.dumps`` of each pending part, in C)."""
        rest = max(0, self._size - after)
        for close, items, i, is_dict in self._stack:
            if close is None:
                rest += len(encode_basestring(items[i:])) - 1          # the text left and its closing quote
                continue
            left = items[i:]
            if left:
                whole = render(dict(left) if is_dict else list(left))
                rest += len(whole) - 2 + (1 if i else 0)               # its items, and a comma before the first
            rest += 1                                                  # the closing bracket
        return rest
