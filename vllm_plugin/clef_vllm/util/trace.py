"""Request timeline events for diagnosis: where a request's time goes between the server's backend
call and vLLM's engine core (another process).

Off unless ``CLEF_VLLM_TRACE`` names a file. Then each event appends one JSON line
``{"t": wall seconds, "pid": ..., "event": ..., "request": ...}``, in the order a request meets them:

- ``submit`` (server process): the backend calls the engine (with the prompt's ``tokens``, and
  ``warmup`` for the server's warm-up prompts);
- ``sent``: AsyncLLM processed the input and handed it to the engine core's socket;
- ``engine_add`` / ``engine_scheduled`` / ``engine_done`` (engine-core process, ``ClefScheduler``):
  the request reached the scheduler, was first scheduled, and finished; ``engine_done`` carries the
  worker's graph counters (``graphs``: :data:`REPORTERS`, cumulative), so the difference between two
  requests at c=1 says whether a request's step replayed the prefill and head graphs or fell back, and why;
- ``engine_sent`` (engine-core process, its output thread) and ``client_decoded`` (server process,
  AsyncLLM's output socket): the finished output was serialised for the socket, and decoded on the other
  side (:func:`instrument_output`; absent with the engine core in a thread, which has no sockets);
- ``received`` (server process): AsyncLLM's output handler got the final output;
- ``answer``: the backend's call returned (with the ``cached`` tokens it started from).

Inside the engine core, per step rather than per request (request ``*``: :data:`STEP`), the worker adds
``step_forward`` (the model's forward begins: vLLM has prepared the step's inputs and attention metadata),
``step_head`` (the pooler begins: the backbone is launched) and ``step_pooled`` (the pooler returned: the
head is launched). A request that had the engine to itself and ran in one step (a short decision at c=1)
gets them as its own, splitting ``its steps`` without a profiler (:func:`step_segments`), which slows
every host op and graph launch it records. Before ``step_forward``, the starts of vLLM's model-runner
methods that prepare the step (:data:`RUNNER_EVENTS`: ``step_runner``, ``step_batch``, ``step_padding``,
``step_metadata``, ``step_inputs``) split vLLM's input preparation the same way.

Wall-clock time is comparable across the processes of one machine.
``python -m clef_vllm.util.trace FILE`` prints the median of each segment between them, per group of
requests (warm-up; prompt length; whether it started from the state cache).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Callable

PATH = os.environ.get("CLEF_VLLM_TRACE") or None
#: ``CLEF_VLLM_PROFILE_PHASES=1``: the worker marks its phases as profiler ranges (``clef_gdn_core``: a
#: GDN layer's core, replayed or not; ``clef_head``: the pooler, i.e. the joint head), so a torch.profiler
#: run can tell which phase the GPU idles in (``bench/latency.py``). Read once, at import: off, the
#: functions are left as they are.
PHASES = os.environ.get("CLEF_VLLM_PROFILE_PHASES") == "1"
#: The phase ranges' names (the worker's wrappers and bench/latency.py use these).
PHASE_GDN_CORE, PHASE_HEAD = "clef_gdn_core", "clef_head"
PHASE_NAMES = (PHASE_GDN_CORE, PHASE_HEAD)
#: With tracing on, the worker registers its graph runners' ``describe`` here (it runs in the engine core's
#: process, beside the scheduler); :func:`report` reads them for ``engine_done``.
REPORTERS: dict = {}


def report() -> dict:
    """The registered runners' counters (replays, captures, fallbacks by reason), by name."""
    return {name: describe() for name, describe in REPORTERS.items()}


class ProfileWindow:
    """``CLEF_VLLM_PROFILE=DIR[,START[,COUNT]]``: torch-profile vLLM's engine core (vLLM's own profiler: its
    traces and a per-op table, ``profiler_out_0.txt``, sorted by GPU time with each op's host time, in DIR)
    over client decisions ``START .. START+COUNT-1`` after the warm-up (default 8 and 10), so the engine
    core of a running server can be compared with ``bench/latency.py``'s in-process profile.
    ``CLEF_VLLM_PROFILE=DIR,START,COUNT,stack`` also records every Python call (the profiler's Python
    tracer: ``python_function`` events), to see which Python code a step's host time goes to; it slows
    every call, so its times rank the code rather than measure it."""

    def __init__(self, directory: str, start: int = 8, count: int = 10, stack: bool = False):
        if not directory or start < 0 or count < 1:
            raise ValueError(f"need DIR[,START>=0[,COUNT>=1[,stack]]], got {directory!r}, {start}, {count}")
        self.directory, self.start, self.count, self.stack = directory, start, count, stack
        self._seen = 0
        self._running = False

    @classmethod
    def from_env(cls, value: str | None = None) -> "ProfileWindow | None":
        value = os.environ.get("CLEF_VLLM_PROFILE") if value is None else value
        if not value:
            return None
        directory, *rest = value.split(",")
        stack = len(rest) == 3 and rest[2] == "stack"
        try:
            if len(rest) > 3 or (len(rest) == 3 and not stack):
                raise ValueError(f"need DIR[,START[,COUNT[,stack]]], got {len(rest) + 1} fields")
            return cls(directory, *(int(n) for n in rest[:2]), stack=stack)
        except ValueError as exc:
            raise ValueError(f"CLEF_VLLM_PROFILE={value!r}: {exc}") from None

    def profiler_config(self) -> dict:
        """vLLM's ``ProfilerConfig`` fields: the engine core only (not AsyncLLM's front end, which would
        add its own overhead to the server process), and Python stacks only when asked (they dominate host
        times)."""
        return {"profiler": "torch", "torch_profiler_dir": self.directory, "torch_profiler_with_stack": self.stack,
                "ignore_frontend": True}

    async def begin(self, engine) -> int:
        """Before a client decision: its index; the first of the window starts the profiler."""
        index, self._seen = self._seen, self._seen + 1
        if index == self.start:
            self._running = await self._switch(engine.start_profile, "start")
        return index

    async def end(self, engine, index: int) -> None:
        """After a client decision: the last of the window stops the profiler (vLLM writes the files)."""
        if index == self.start + self.count - 1 and self._running:
            self._running = False
            await self._switch(engine.stop_profile, "stop")

    @property
    def running(self) -> bool:
        return self._running

    @contextlib.asynccontextmanager
    async def around(self, engine):
        """Around one request: counts it, starting the profiler before the window's first and stopping
        it after its last (:meth:`begin`, :meth:`end`), whatever the request raised."""
        index = await self.begin(engine)
        try:
            yield
        finally:
            await self.end(engine, index)

    async def finish(self, engine) -> None:
        """At shutdown: a window the traffic did not complete (fewer decisions than START+COUNT) is
        stopped, so vLLM still writes the decisions it saw; without this the profile was lost."""
        if self._running:
            self._running = False
            seen = self._seen - self.start
            logging.getLogger("clef_vllm").warning(
                "CLEF_VLLM_PROFILE: the engine stops after %d of the window's %d requests; "
                "stopping vLLM's profiler now", seen, self.count)
            await self._switch(engine.stop_profile, "stop")

    async def _switch(self, call, what: str) -> bool:
        """A profiler that fails is logged, never a failed decision (this is a diagnosis aid)."""
        log = logging.getLogger("clef_vllm")
        try:
            await call()
        except Exception as exc:  # noqa: BLE001
            log.warning("CLEF_VLLM_PROFILE: could not %s vLLM's profiler (%s: %s)", what, type(exc).__name__, exc)
            return False
        log.info("CLEF_VLLM_PROFILE: vLLM's profiler %s (client decisions %d..%d; files in %s)",
                 {"start": "started", "stop": "stopped"}[what], self.start, self.start + self.count - 1, self.directory)
        return True


def phased(name: str, fn):
    """``fn`` inside a profiler range ``name`` when :data:`PHASES` is on; else ``fn`` itself."""
    if not PHASES:
        return fn
    import functools

    from torch.profiler import record_function

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def event(name: str, request_id: str, **fields) -> None:
    """Append one event, with any extra ``fields`` (a no-op unless ``CLEF_VLLM_TRACE`` is set)."""
    if PATH is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": name, "request": request_id, **fields}) + "\n"
    with open(PATH, "a", encoding="utf-8") as f:
        f.write(line)


def instrument(engine) -> None:
    """With tracing on, wrap an ``AsyncLLM``'s hand-offs (instance attributes, looked up per call, so
    this works after the output handler started) to log ``sent`` and ``received``."""
    if PATH is None:
        return
    core, outputs = engine.engine_core, engine.output_processor
    add, process = core.add_request_async, outputs.process_outputs

    async def add_request_async(request, *args, **kwargs):
        result = await add(request, *args, **kwargs)
        event("sent", request.request_id)
        return result

    def process_outputs(engine_core_outputs, *args, **kwargs):
        for out in engine_core_outputs:
            if out.finished:
                event("received", out.request_id)
        return process(engine_core_outputs, *args, **kwargs)

    core.add_request_async = add_request_async
    outputs.process_outputs = process_outputs
    instrument_output("client")


def _finished_ids(outputs) -> list[str]:
    """The request ids of the finished requests in an ``EngineCoreOutputs`` (none for anything else)."""
    if type(outputs).__name__ != "EngineCoreOutputs":
        return []
    return [o.request_id for o in outputs.outputs or () if getattr(o, "finish_reason", None) is not None]


#: the attribute that says a vLLM method is already wrapped by this module
MARKED = "_clef_trace"


def _wrap_once(cls, attr: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace ``cls.attr`` by ``make(original)``, marked, unless the method found there (its own or a base
    class's) is marked already. Returns whether it wrapped."""
    import functools

    original = getattr(cls, attr)
    if getattr(original, MARKED, False):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, MARKED, True)
    setattr(cls, attr, wrapper)
    return True


def instrument_output(side: str) -> bool:
    """With tracing on, mark a finished request's output where it leaves the engine core (``side="engine"``:
    vLLM's msgpack encoder, in its output thread: ``engine_sent``) and where the server process decoded it
    (``side="client"``: the decoder of AsyncLLM's output socket: ``client_decoded``). Class-level, once
    (a wrapper already in place is kept); the engine core in a thread (no sockets) meets neither. Returns
    whether it wrapped."""
    if PATH is None:
        return False
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    if side == "engine":
        def make(encode_into):
            def marked(self, obj, *args, **kwargs):
                out = encode_into(self, obj, *args, **kwargs)
                for rid in _finished_ids(obj):
                    event("engine_sent", rid)
                return out
            return marked

        return _wrap_once(MsgpackEncoder, "encode_into", make)

    def make(decode):
        def marked(self, *args, **kwargs):
            out = decode(self, *args, **kwargs)
            for rid in _finished_ids(out):
                event("client_decoded", rid)
            return out
        return marked

    return _wrap_once(MsgpackDecoder, "decode", make)


def instrument_runner(runner_cls=None) -> list[str]:
    """With tracing on, mark the start of each of :data:`RUNNER_EVENTS`' methods of vLLM's model runner
    (the class, once per process; the worker calls this where the model is built) with its step event.
    Returns the methods marked; a method this vLLM lacks is skipped with a warning."""
    if PATH is None:
        return []
    if runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls
    marked = []
    for name, method in RUNNER_EVENTS:
        if getattr(runner_cls, method, None) is None:
            logging.getLogger("clef_vllm").warning("CLEF_VLLM_TRACE: vLLM's model runner has no %s; no %s events",
                                                   method, name)
            continue

        def make(fn, name=name):
            def marking(*args, **kwargs):
                event(name, STEP)
                return fn(*args, **kwargs)
            return marking

        _wrap_once(runner_cls, method, make)             # wrapped before (here or in a base class): kept
        marked.append(method)
    return marked


#: The request of the worker's per-step events.
STEP = "*"
#: vLLM's model-runner methods whose start the worker marks, in the order a step calls them (event, method):
#: they split vLLM's input preparation (:func:`instrument_runner`).
RUNNER_EVENTS = (("step_runner", "execute_model"), ("step_batch", "_prepare_inputs"),
                 ("step_padding", "_determine_batch_execution_and_padding"),
                 ("step_metadata", "_build_attention_metadata"), ("step_inputs", "_preprocess"))
#: The worker's per-step events, in the order a step meets them.
STEP_EVENTS = tuple(name for name, _ in RUNNER_EVENTS) + ("step_forward", "step_head", "step_pooled")
#: What the time up to each step event (and from the last one to ``engine_done``) is spent on.
_STEP_WHAT = {"step_runner": "the executor's hand-off to the model runner",
              "step_batch": "the runner's request states and input batch (_update_states)",
              "step_padding": "positions, token ids, block tables, slot mapping (_prepare_inputs)",
              "step_metadata": "the step's padding and graph mode, the state copies and slot mappings",
              "step_inputs": "the attention metadata (the FA3 and GDN builders)",
              "step_forward": "the model's inputs and the forward context",
              "step_head": "the backbone's launch (the step graph's feed and replay)",
              "step_pooled": "the pooler: the head's inputs and launch",
              "engine_done": "the GPU's remaining work, the output to the host, the update"}


def step_segments(present) -> tuple[tuple[str, str, str], ...]:
    """``its steps`` split at the step events in ``present`` (traces without the runner's events split at
    ``step_forward`` and after)."""
    chain = ["engine_scheduled"] + [e for e in STEP_EVENTS if e in present] + ["engine_done"]
    out = []
    for a, b in zip(chain, chain[1:]):
        what = _STEP_WHAT[b] if (a, b) != ("engine_scheduled", "step_forward") else \
            "vLLM's input preparation and metadata"
        out.append((a, b, "  " + what))
    return tuple(out)


#: The output's way back, split where the engine core serialised it (``engine_sent``, its output thread) and
#: where the server process decoded it (``client_decoded``, AsyncLLM's socket task): :func:`instrument_output`.
OUTPUT_EVENTS = ("engine_sent", "client_decoded")
_OUTPUT_WHAT = {"engine_sent": "the engine core's output thread: the step's outputs serialised",
                "client_decoded": "ZMQ to the server process, decoded there",
                "received": "AsyncLLM's output queue, to its output handler"}


def output_segments(present) -> tuple[tuple[str, str, str], ...]:
    """``engine_done -> received`` split at the output events in ``present`` (none: nothing to split)."""
    chain = ["engine_done"] + [e for e in OUTPUT_EVENTS if e in present] + ["received"]
    if len(chain) == 2:
        return ()
    return tuple((a, b, "  " + _OUTPUT_WHAT[b]) for a, b in zip(chain, chain[1:]))


#: The segments of one request's timeline, between consecutive events.
SEGMENTS = (("submit", "sent", "AsyncLLM's input processing"),
            ("sent", "engine_add", "to the engine core's scheduler (IPC, request setup, hashing)"),
            ("engine_add", "engine_scheduled", "waiting for a step"),
            ("engine_scheduled", "engine_done", "its steps"),
            ("engine_done", "received", "back to the server process (output, IPC)"),
            ("received", "answer", "AsyncLLM's output handling, back to the backend"))


def graph_delta(before: dict, now: dict) -> dict:
    """What each graph runner did between two :func:`report` snapshots: replays, and fallbacks by reason."""
    out = {}
    for name, cur in now.items():
        prev = before.get(name, {})
        fell, fell_before = cur.get("fallbacks", {}), prev.get("fallbacks", {})
        out[name] = {"replays": cur.get("replays", 0) - prev.get("replays", 0),
                     "fallbacks": {r: n - fell_before.get(r, 0) for r, n in fell.items() if n != fell_before.get(r, 0)}}
    return out


def timelines(lines) -> dict[str, dict]:
    """Per request (the server's id), the first time of each event, and the extra fields of its
    events (``tokens``, ``cached``, ``warmup``; ``graph_delta``: what the worker's graph runners did
    since the previous ``engine_done``, i.e. in this request's steps when it ran alone). The engine
    core's ids are the server's plus vLLM's ``-xxxxxxxx`` suffix; they are mapped back by prefix."""
    events = [json.loads(line) for line in lines if line.strip()]
    ours = {e["request"] for e in events if e["event"] in ("submit", "answer")}       # the backend's ids
    out: dict[str, dict] = {}
    graphs: dict = {}
    steps = [e for e in events if e["request"] == STEP]
    for e in events:
        rid = e["request"]
        if rid == STEP:
            continue
        if rid not in ours:
            base = rid.rsplit("-", 1)[0]
            rid = base if base in ours else rid
        entry = out.setdefault(rid, {})
        entry.setdefault(e["event"], e["t"])
        entry.update((k, v) for k, v in e.items() if k not in ("t", "pid", "event", "request", "graphs"))
        if e["event"] == "engine_done" and "graphs" in e:
            entry["graph_delta"] = graph_delta(graphs, e["graphs"])
            graphs = e["graphs"]
    for entry in out.values():          # the worker's step events, for a request of exactly one step
        if "engine_scheduled" in entry and "engine_done" in entry:
            inside = sorted((e for e in steps if entry["engine_scheduled"] <= e["t"] <= entry["engine_done"]),
                            key=lambda e: e["t"])
            names = [e["event"] for e in inside]
            if "step_forward" in names and names == [n for n in STEP_EVENTS if n in names]:   # one step's, in order
                entry.update((e["event"], e["t"]) for e in inside)
    return out


def group_of(timeline: dict) -> str:
    """The class a traced request is summarised in: the warm-up's, else its prompt length and whether
    it started from the state cache."""
    if timeline.get("warmup"):
        return "warm-up"
    n = timeline.get("tokens")
    size = ("?" if n is None else "<= 1,024 tokens" if n <= 1024 else "<= 8,192 tokens" if n <= 8192
            else "> 8,192 tokens")
    return f"{size}, cache hit" if timeline.get("cached") else size


def grouped(lines, alone: bool = False) -> dict[str, list[dict]]:
    """The traced requests' timelines by :func:`group_of`. ``alone``: only requests that had the server
    to themselves (no other traced request between their submit and answer: a c=1 point)."""
    ours = [t for t in timelines(lines).values() if "submit" in t and "answer" in t]   # engine-only: no pair
    if alone:
        spans = sorted((t["submit"], t["answer"]) for t in ours)
        ours = [t for t in ours if sum(s < t["answer"] and e > t["submit"] for s, e in spans) == 1]
    groups: dict[str, list[dict]] = {}
    for t in ours:
        groups.setdefault(group_of(t), []).append(t)
    return dict(sorted(groups.items()))


def graph_summary(lines, alone: bool = False) -> dict[str, dict]:
    """Per group, per graph runner: the median replays per request and the fallbacks by reason, summed
    (from ``graph_delta``: exact for requests that ran alone, as at c=1)."""
    import statistics

    out = {}
    for name, per in grouped(lines, alone).items():
        deltas = [t["graph_delta"] for t in per if "graph_delta" in t]
        runners = {}
        for runner in sorted({r for d in deltas for r in d}):
            fell: dict[str, int] = {}
            for d in deltas:
                for reason, n in d.get(runner, {}).get("fallbacks", {}).items():
                    fell[reason] = fell.get(reason, 0) + n
            runners[runner] = {"requests": len(deltas), "fallbacks": fell,
                               "replays_p50": statistics.median(d.get(runner, {}).get("replays", 0) for d in deltas)}
        if runners:
            out[name] = runners
    return out


def summary(lines, alone: bool = False) -> dict[str, dict]:
    """Per group (:func:`group_of`), the median milliseconds of each segment over the requests that
    have both of its ends, and how many had. ``alone``: see :func:`grouped`."""
    import statistics

    out = {}
    for name, per in grouped(lines, alone).items():
        rows = {}
        present = {e for t in per for e in STEP_EVENTS + OUTPUT_EVENTS if e in t}
        steps = step_segments(present) if present & set(STEP_EVENTS) else ()
        for a, b, what in SEGMENTS[:4] + steps + SEGMENTS[4:5] + output_segments(present) + SEGMENTS[5:] + (
                ("submit", "answer", "the backend's engine call"),):
            values = [(t[b] - t[a]) * 1000 for t in per if a in t and b in t]
            rows[f"{a} -> {b}"] = {"what": what, "requests": len(values),
                                   "p50_ms": round(statistics.median(values), 3) if values else None}
        out[name] = rows
    return out


def main(argv=None) -> int:
    """``python -m clef_vllm.util.trace FILE``: the median of each segment of the traced requests."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m clef_vllm.util.trace", description=main.__doc__)
    ap.add_argument("file", help="a CLEF_VLLM_TRACE file")
    ap.add_argument("--alone", action="store_true",
                    help="only requests that had the server to themselves (no other request in flight)")
    a = ap.parse_args(argv)
    with open(a.file, encoding="utf-8") as f:
        lines = f.readlines()
    graphs = graph_summary(lines, alone=a.alone)
    for group, rows in summary(lines, alone=a.alone).items():
        print(f"## {group}")
        for name, row in rows.items():
            p50 = "-" if row["p50_ms"] is None else f"{row['p50_ms']:.2f} ms"
            print(f"{name:36s} {p50:>11s}  ({row['requests']} requests)  {row['what']}")
        for runner, g in graphs.get(group, {}).items():
            fell = ", ".join(f"{r} {n}" for r, n in sorted(g["fallbacks"].items())) or "none"
            print(f"{runner + ' graphs':36s} {g['replays_p50']:>8g} replays per request (median of {g['requests']}); "
                  f"fallbacks: {fell}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
