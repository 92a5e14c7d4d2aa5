"""Request timeline events for diagnosis: where a request's time goes between the server's backend
call and vLLM's engine core (another process).

Off unless ``CLEF_VLLM_TRACE`` names a file. Then each event appends one JSON line
``{"t": wall seconds, "pid": ..., "event": ..., "request": ...}``: ``submit`` / ``answer`` around the
backend's engine call (server process), ``engine_add`` / ``engine_scheduled`` / ``engine_done`` in
the engine core (``ClefScheduler``). Wall-clock time is comparable across the processes of one machine.
"""

from __future__ import annotations

import json
import os
import time

PATH = os.environ.get("CLEF_VLLM_TRACE") or None


def event(name: str, request_id: str) -> None:
    """Append one event (a no-op unless ``CLEF_VLLM_TRACE`` is set)."""
    if PATH is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": name, "request": request_id}) + "\n"
    with open(PATH, "a", encoding="utf-8") as f:
        f.write(line)
