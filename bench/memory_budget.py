"""GPU memory budgets: the Clef server inside a smaller card's memory, emulated honestly on a big GPU.

A *ballast* process holds all of the GPU's memory but what a smaller card gives CUDA (``USABLE_GIB``),
so the server that starts next sees that card: ``--gpu-memory-utilization`` is vLLM's default share
(0.9) of the emulated card, and going past it is a real out-of-memory, not a log line. One *row*
starts the ballast, the server (``clef-systemone --model CKPT --load-format clef-dummy
--gpu-memory-utilization U [FLAGS]``), samples the server's GPU memory with NVML every 0.25 s, runs a
load mix with clef-bench's own request factory and load generator (short requests at c=1 and c=16,
four ~16k-token requests at once, a shared state so the state cache hits), stops the server, and with
``--raw`` measures raw vLLM pooling of the same short requests' token ids at the same budget, alone.

    # on the GPU machine, from the repository root: the staged vLLM and this tree's plugin on PYTHONPATH
    source bench/setup.sh && python3 bench/make_ckpt.py 9b /root/ckpt/9b-hybrid --hybrid 17
    # one row
    python3 bench/memory_budget.py run --card 16 --ckpt /root/ckpt/9b-hybrid --out results.json [--raw] \\
        [--load-seconds 120] [-- --nvfp4-kernel vllm ...]
    # the matrix: 16, 24, 32 GB and the full card, raw vLLM at 24; JSON + logs tar.gz + summary in DIR
    python3 bench/memory_budget.py matrix --ckpt /root/ckpt/9b-hybrid --cards 16,24,32,full --raw-at 24 --out-dir DIR
    # a machine that allows 10 minutes a command: the matrix in calls that each fit, rows merged in DIR
    python3 bench/memory_budget.py matrix --ckpt CKPT --cards 16,24 --raw-at 24 --out-dir /root/mb --time-budget 560
    python3 bench/memory_budget.py matrix --ckpt CKPT --cards 32,full --raw-at '' --out-dir /root/mb --time-budget 560
    # the README's "GPU memory" table from a results file (CPU)
    python3 bench/memory_budget.py table bench/results/memory_budget.json
    # the ballast alone (holds all but CARD GiB until killed)
    python3 bench/memory_budget.py ballast --card 15.92

A row (one JSON object; ``run`` appends it to ``--out``, a JSON list):

- ``card_gib``: the emulated card (16, 24, 32; the full card: its CUDA total in GiB); ``budget_gib``:
  0.9 × what the card gives CUDA; ``device_total_gib``: the real device's CUDA total; ``gpu``: its name.
- ``flags``: the server flags beyond ``--model``, ``--load-format`` and ``--gpu-memory-utilization``
  ("" = the product's defaults); ``command``: the server's command line as run.
- ``started``; ``oom``: the server's log says "out of memory", "OutOfMemoryError" or "CUDA error";
  ``died``: the server exited before it was stopped (at start or under load).
- ``kv_cache_gib``: from the last ``clef memory budget:`` line's last "KV cache X GiB" when the plugin logs
  one (its worker takes the CUDA context and its own graphs out of vLLM's figure; that line gives the final
  size), else vLLM's last "Available KV cache memory: X GiB"; ``kv_tokens`` / ``max_concurrency_16k``: vLLM's "GPU KV cache size: N tokens,
  Maximum concurrency for 16,384 tokens per request: X x" (for another ``--max-model-len``: N / 16,384,
  approximate for a hybrid model); ``plan_kv_cache_gib``: the ``clef memory plan:`` line's "KV cache X
  GiB", else null.
- ``peak_process_gib``: the most the server's processes held at once, by the driver's count (NVML
  ``usedGpuMemory`` summed over the GPU's compute processes that were not there before the server
  started, the ballast's among them), from the server's start to its stop; where NVML lists no
  per-process figure, the device's used memory less what it was before the server started.
- ``short_p50_ms`` (c=1, client-side), ``short_c16_req_per_s``, ``raw_short_c16_req_per_s`` (raw vLLM
  ``embed`` pooling of the same token ids at the same budget, c=16, ~30 s; null without ``--raw``);
  ``raw_note``: why raw vLLM has no figure; ``errors``: answers other than 200 over the load;
  ``state_cache_hits``: answers that read cached state tokens; ``long_ok``: every long request answered
  200 (null when none was sent); ``load_seconds``: the load's wall time; ``image_p50_ms`` / ``images_ok``
  (``--image-px``): the images phase's p50 at c=4 and whether every image request answered 200 (null without it;
  with ``--video-frames``, every other request of that phase carries a video instead, and counts the same way).
- ``log_lines``: vLLM's "Model loading took…", "Available KV cache memory…", "GPU KV cache size…"
  lines and the plugin's ``clef memory…`` lines, verbatim (colour codes removed); a server that did not
  start adds its log's last lines.

Time: a row is the server's start (~40-90 s warm, ~3 min on a fresh machine), ``--load-seconds`` of load after
a few seconds of warm-up, its stop (~10 s); raw vLLM adds its own start and ``--raw-seconds``. ``matrix
--time-budget S`` skips a row that would end past S seconds (by ``--start-estimate``) instead of being cut off
mid-row; every line on stderr carries the UTC time and the seconds since the start.

Next to the output: ``memory_budget_<row>_server.log.gz`` (and ``_raw.log.gz``, ``_ballast.log``),
``memory_budget_<row>_load.json`` (each load phase's clef-bench point). Every child runs in its own
process group, dies with this process (``PR_SET_PDEATHSIG``), and is stopped on any error, timeout or
signal: the ballast is never left holding the GPU. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime as dt
import gzip
import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

GIB = float(1 << 30)
MIB = 1 << 20

#: What a card of each nominal size gives CUDA (``cudaMemGetInfo``'s total, GiB): less than its nominal size,
#: since the driver and the display keep part of it. 16 GB: 15.92 GiB (an RTX 5070 Ti, the issue's card);
#: 24 GB: 23.5 GiB (RTX 4090 / 3090 report about 23.6-23.7, an L4 about 22.5: a figure between, on the
#: safe side for the consumer cards); 32 GB: 31.35 GiB (an RTX 5090). Another card: ``--card NOMINAL=USABLE``.
USABLE_GIB = {"16": 15.92, "24": 23.5, "32": 31.35}
#: vLLM's default ``--gpu-memory-utilization``: the share of the card the server may use.
VLLM_DEFAULT_SHARE = 0.9
#: The row's keys, in order (the issue's schema, then the driver's own).
ROW_KEYS = ("card_gib", "budget_gib", "flags", "started", "oom", "kv_cache_gib", "kv_tokens", "max_concurrency_16k",
            "peak_process_gib", "plan_kv_cache_gib", "short_p50_ms", "short_c16_req_per_s",
            "raw_short_c16_req_per_s", "gpu", "command", "log_lines",
            "raw_note", "errors", "state_cache_hits", "long_ok", "device_total_gib", "load_seconds", "died",
            "image_p50_ms", "images_ok")
RESULTS_NAME = "memory_budget.json"
READY_TIMEOUT_S = 360.0
SAMPLE_PERIOD_S = 0.25

_T0 = time.monotonic()


def say(msg: str) -> None:
    """A timestamped progress line on stderr (UTC time and seconds since this process started)."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S")
    print(f"[memory_budget {now} +{time.monotonic() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- log parsing

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LOADING = re.compile(r"Model loading took (-?[\d.]+) GiB")
_AVAILABLE = re.compile(r"Available KV cache memory: (-?[\d.]+) GiB")
_KV_SIZE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+) ?x")
_CLEF_MEMORY = re.compile(r"\bclef memory(?: [a-z_-]+)?:")
#: the last "KV cache X GiB" of a plan / budget line (the budget line names vLLM's figure first, its own last)
_PLAN_KV = re.compile(r"\bclef memory plan:.*KV cache\s+(-?[\d.]+) GiB")
_BUDGET_KV = re.compile(r"\bclef memory budget:.*KV cache (-?[\d.]+) GiB")
_OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error", re.IGNORECASE)
#: at most this many ``clef memory:`` ledger lines (the first and last halves); plan and budget lines always
MAX_LEDGER_LINES = 24


def parse_server_log(text: str, max_model_len: int = 16384) -> dict:
    """The memory figures and verbatim lines of one server log (see the module docstring for each field)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    kept: list[str] = []
    ledger: list[int] = []
    out: dict[str, Any] = {"model_loading_gib": None, "available_kv_gib": None, "budget_kv_gib": None,
                           "plan_kv_cache_gib": None, "kv_tokens": None, "max_concurrency_16k": None}
    for ln in lines:
        m = _LOADING.search(ln)
        if m:
            out["model_loading_gib"] = float(m.group(1))
            kept.append(ln)
            continue
        m = _AVAILABLE.search(ln)
        if m:
            out["available_kv_gib"] = float(m.group(1))     # the last one counts
            kept.append(ln)
            continue
        size, conc = _KV_SIZE.search(ln), _CONCURRENCY.search(ln)
        if size or conc:
            if size:
                out["kv_tokens"] = int(size.group(1).replace(",", ""))
            if conc:
                per = int(conc.group(1).replace(",", ""))
                out["max_concurrency_16k"] = float(conc.group(2)) if per == 16384 else None
            kept.append(ln)
            continue
        if _CLEF_MEMORY.search(ln):
            m = _PLAN_KV.search(ln)
            if m:
                out["plan_kv_cache_gib"] = float(m.group(1))
            m = _BUDGET_KV.search(ln)
            if m:
                out["budget_kv_gib"] = float(m.group(1))
            if not (_PLAN_KV.search(ln) or _BUDGET_KV.search(ln) or "clef memory plan:" in ln
                    or "clef memory budget:" in ln):
                ledger.append(len(kept))
            kept.append(ln)
    if len(ledger) > MAX_LEDGER_LINES:                     # many ledger lines under load: the first and last
        half = MAX_LEDGER_LINES // 2
        drop = set(ledger[half:-half])
        kept = [ln for i, ln in enumerate(kept) if i not in drop]
    if out["max_concurrency_16k"] is None and out["kv_tokens"] is not None:
        out["max_concurrency_16k"] = round(out["kv_tokens"] / 16384, 2)
    out["kv_cache_gib"] = out["budget_kv_gib"] if out["budget_kv_gib"] is not None else out["available_kv_gib"]
    out["kv_source"] = ("clef memory budget" if out["budget_kv_gib"] is not None else
                        "vLLM Available KV cache memory" if out["available_kv_gib"] is not None else None)
    out["oom"] = bool(_OOM.search(text))
    out["log_lines"] = kept
    return out


def log_tail(text: str, n: int = 25) -> list[str]:
    """The last ``n`` non-empty lines (colour codes removed)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    return [ln for ln in lines if ln.strip()][-n:]


def failure_reason(text: str) -> str:
    """One line saying why a process failed: its last exception-like line, else its last line."""
    tail = log_tail(text, 200)
    for ln in reversed(tail):
        if re.search(r"(Error|Exception|error:|out of memory|No available memory)", ln):
            return ln.strip()[-400:]
    return tail[-1].strip()[-400:] if tail else "no output"


# --------------------------------------------------------------------------- cards


@dataclass(frozen=True)
class Card:
    """An emulated card: ``key`` as given (``16``, ``full``, ``12=11.6``), ``usable_gib`` what it gives CUDA
    (``None``: the whole device, no ballast)."""

    key: str
    nominal: float | None
    usable_gib: float | None

    @property
    def full(self) -> bool:
        return self.usable_gib is None

    @property
    def slug(self) -> str:
        return "full" if self.full else f"{self.nominal:g}gb"


def parse_card(text: str) -> Card:
    text = text.strip().lower()
    if text == "full":
        return Card("full", None, None)
    if "=" in text:
        nominal, _, usable = text.partition("=")
        return Card(text, float(nominal), float(usable))
    if text in USABLE_GIB:
        return Card(text, float(text), USABLE_GIB[text])
    raise ValueError(f"card {text!r}: one of {', '.join(USABLE_GIB)}, full, or NOMINAL=USABLE_GIB (e.g. 12=11.6)")


def share_for(usable_gib: float, device_total_gib: float) -> float:
    """``--gpu-memory-utilization`` giving 0.9 of ``usable_gib`` on a device of ``device_total_gib`` (rounded
    down at the 5th decimal, so the budget never exceeds the card's)."""
    return math.floor(VLLM_DEFAULT_SHARE * usable_gib / device_total_gib * 1e5) / 1e5


# --------------------------------------------------------------------------- NVML


class Gpu:
    """One GPU through NVML (``vllm.third_party.pynvml``, else ``pynvml``): name, total, used memory and
    compute processes. This process never touches CUDA (it would hold a context on the device)."""

    def __init__(self, index: int | None = None):
        try:
            from vllm.third_party import pynvml
        except Exception:  # noqa: BLE001 - any vLLM import problem: the standalone binding
            import pynvml
        self.nv = pynvml
        pynvml.nvmlInit()
        if index is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            index = int(visible) if visible.isdigit() else 0
        self.index = index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def name(self) -> str:
        n = self.nv.nvmlDeviceGetName(self.handle)
        return n.decode() if isinstance(n, bytes) else str(n)

    def used_bytes(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def processes(self) -> list[tuple[int, int | None]]:
        """(pid as NVML reports it, usedGpuMemory or None) of each compute process on the device."""
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)]


class MemorySampler:
    """Samples, every :data:`SAMPLE_PERIOD_S`, what the processes that were not on the GPU at :meth:`start`
    hold (NVML per-process sums; where NVML lists none of them with a figure, the device's used memory
    less its value at start), and keeps the peak."""

    def __init__(self, gpu: Gpu | None, period: float = SAMPLE_PERIOD_S):
        self.gpu, self.period = gpu, period
        self.peak_proc: int | None = None
        self.peak_device: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: set[int] = set()
        self._used0 = 0

    def start(self) -> "MemorySampler":
        if self.gpu is None:
            return self
        self._before = {pid for pid, _ in self.gpu.processes()}
        self._used0 = self.gpu.used_bytes()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def new_processes(self) -> list[tuple[int, int | None]]:
        return [] if self.gpu is None else [(p, m) for p, m in self.gpu.processes() if p not in self._before]

    def sample(self) -> None:
        procs = self.new_processes()
        figures = [m for _, m in procs if m is not None]
        if figures:
            self.peak_proc = max(self.peak_proc or 0, sum(figures))
        device = self.gpu.used_bytes() - self._used0
        self.peak_device = max(self.peak_device or 0, device)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed NVML query skips one sample
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def peak_bytes(self) -> int | None:
        return self.peak_proc if self.peak_proc is not None else self.peak_device

    @property
    def method(self) -> str:
        return ("NVML usedGpuMemory of the server's processes" if self.peak_proc is not None else
                "device used memory less its value before the server" if self.peak_device is not None else "none")

    def wait_released(self, timeout: float = 60.0) -> bool:
        """Until no process that came after :meth:`start` is on the GPU (True), or ``timeout``."""
        if self.gpu is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.new_processes():
                    return True
            except Exception:  # noqa: BLE001
                return True
            time.sleep(0.5)
        return False


# --------------------------------------------------------------------------- child processes

_LIVE: dict[int, subprocess.Popen] = {}   # process-group id -> leader, for cleanup on any exit


def _libc():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:                  # not Linux: the process-group cleanup still applies
        return None


_LIBC = _libc()                      # loaded here: the child between fork and exec imports nothing


def _die_with_parent(sig: int) -> Callable[[], None]:
    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(1, int(sig))         # PR_SET_PDEATHSIG: signalled when this process dies
    return preexec


def spawn(cmd: Sequence[str], log_path: Path, *, env: dict | None = None, parent_death: int = signal.SIGTERM,
          stdout_pipe: bool = False) -> subprocess.Popen:
    """``cmd`` in a new session (its own process group), output to ``log_path`` (or stdout to a pipe),
    signalled ``parent_death`` when the thread that started it ends (the driver's main thread: this process)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE if stdout_pipe else log, stderr=log,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent(parent_death))
    log.close()
    _LIVE[proc.pid] = proc
    return proc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(proc: subprocess.Popen, first: int = signal.SIGINT, grace: float = 30.0) -> int | None:
    """``first`` to the process group, then SIGKILL to whatever of the group is left after ``grace`` seconds;
    returns the leader's exit status."""
    pgid = proc.pid
    try:
        if proc.poll() is None or _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, first)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (proc.poll() is None or _group_alive(pgid)):
                time.sleep(0.1)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    finally:
        _LIVE.pop(pgid, None)
    return proc.returncode


def _cleanup_all() -> None:
    for pgid in list(_LIVE):
        proc = _LIVE.pop(pgid)
        with contextlib.suppress(Exception):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)


atexit.register(_cleanup_all)


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """SIGTERM / SIGHUP end the driver through its ``finally`` blocks (SIGINT does already)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)


def _child_env(drop_alloc_conf: bool = False) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if drop_alloc_conf:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


# --------------------------------------------------------------------------- the ballast


class Ballast:
    """The ballast child (``memory_budget.py ballast --card USABLE``): holds all of the GPU but ``usable_gib``;
    ``usable_gib=None`` only probes the device's CUDA total and exits."""

    def __init__(self, usable_gib: float | None, log_path: Path, cmd: Sequence[str] | None = None):
        self.usable_gib, self.log_path = usable_gib, log_path
        self.cmd = list(cmd) if cmd is not None else [
            sys.executable, str(Path(__file__).resolve()), "ballast",
            *(["--probe"] if usable_gib is None else ["--card", f"{usable_gib}"])]
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self, timeout: float = 180.0) -> dict:
        """Start it and wait for its ``BALLAST {json}`` line (held, free and total bytes, pid, device name);
        RuntimeError, with the reason from its log, when it exits or stays silent ``timeout`` seconds."""
        cmd = self.cmd
        self.proc = spawn(cmd, self.log_path, env=_child_env(drop_alloc_conf=True), parent_death=signal.SIGKILL,
                          stdout_pipe=True)
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("BALLAST ") and line.rstrip().endswith("}"):
                    self.info = json.loads(line[len("BALLAST "):])
                    return self.info
        self.stop()
        raise RuntimeError(f"the ballast did not report: {failure_reason(self.log_path.read_text(errors='replace'))}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM, grace=10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


def ballast_main(card_gib: float | None, probe: bool) -> int:
    """Child: hold all of the device's memory but ``card_gib`` GiB (plain ``torch.empty`` on CUDA), print a
    ``BALLAST {json}`` line, sleep until killed (or until the parent is gone)."""
    import torch

    if not torch.cuda.is_available():
        print("ballast: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    if probe:
        print("BALLAST " + json.dumps({"held": 0, "free": free, "total": total, "pid": os.getpid(),
                                       "name": torch.cuda.get_device_name()}), flush=True)
        return 0
    target = int(card_gib * GIB)
    if free < target:
        print(f"ballast: only {free / GIB:.2f} GiB free, less than the card's {card_gib} GiB", file=sys.stderr)
        return 3
    held: list = []
    chunk = 2 * MIB
    need = (free - target) // chunk * chunk
    if need > 0:
        held.append(torch.empty(need, dtype=torch.uint8, device="cuda"))
    # top up what the first allocation's own overhead left: PyTorch's allocator gives a request of 1-10 MiB a
    # 20 MiB segment, so only exact amounts (12 MiB and more, in 2 MiB steps) are added; the card then gives
    # CUDA at most ~12 MiB more than its size, never less
    for _ in range(64):
        free = torch.cuda.mem_get_info()[0]
        step = (free - target) // chunk * chunk
        if step < 12 * MIB:
            break
        held.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
    free, total = torch.cuda.mem_get_info()
    nbytes = sum(t.numel() for t in held)
    print(f"ballast: holding {nbytes / GIB:.2f} GiB in {len(held)} tensors; {free / GIB:.3f} GiB of "
          f"{total / GIB:.2f} GiB free (card {card_gib} GiB)", file=sys.stderr, flush=True)
    print("BALLAST " + json.dumps({"held": nbytes, "free": free, "total": total, "pid": os.getpid(),
                                   "name": torch.cuda.get_device_name()}), flush=True)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while os.getppid() == parent:
        time.sleep(0.5)
    return 0


# --------------------------------------------------------------------------- requests and load


@dataclass
class Pools:
    """The load mix's requests, generated once (the same at every card): short, long and shared-state."""

    short: list
    long: list
    shared: list
    shared_warm: list
    settings: dict
    images: list = field(default_factory=list)


def build_pools(ckpt: str, *, seed: int = 0, short_tokens: int = 360, long_tokens: int = 16384,
                shared_tokens: int = 15872, max_model_len: int = 16384, n_short: int = 256, n_long: int = 48,
                n_shared: int = 96, keep_ids: bool = False, image_px: int = 0, n_images: int = 12,
                video_frames: int = 0) -> Pools:
    """clef-bench's ``short``, ``long`` and ``shared-state`` variants on the checkpoint's tokenizer; with
    ``image_px``, ``n_images`` short requests that each carry one picture of ``image_px`` squared (a different one each:
    the engine's encoder at the largest image a 16 GB card takes, 2,048 squared); with ``video_frames`` too, every
    other one carries a video of that many frames of half that side instead (as many vision tokens for 8 frames)."""
    from clef_vllm.bench.workloads import WARM_START, RequestFactory, build_variants
    from clef_vllm.schema.encoding import RequestEncoder

    encoder = RequestEncoder.from_pretrained(ckpt, max_length=max_model_len)
    factory = RequestFactory(encoder, seed=seed, keep_ids=keep_ids)
    variants = build_variants(["short", "long", "shared-state"], short_tokens=short_tokens, long_tokens=[long_tokens],
                              shared_states=[(shared_tokens, n_shared)])
    short, long, shared = variants
    short_pool = factory.requests(short, n_short)
    return Pools(short=short_pool, long=factory.requests(long, n_long),
                 shared=factory.requests(shared, n_shared), shared_warm=factory.requests(shared, 2, start=WARM_START),
                 settings={"seed": seed, "short_tokens": short_tokens, "long_tokens": long_tokens,
                           "shared_state_tokens": shared_tokens, "variants": [v.name for v in variants],
                           "image_px": image_px, "image_requests": n_images if image_px else 0,
                           "video_frames": video_frames if image_px else 0},
                 images=image_requests(short_pool, image_px, n_images, seed, video_frames) if image_px else [])


def image_requests(short: list, px: int, n: int, seed: int, video_frames: int = 0) -> list:
    """``n`` of the short requests, each with one JPEG picture of ``px`` x ``px``, or (every other one, with
    ``video_frames``) a video of that many JPEG frames of ``px / 2`` squared (expected tokens unknown)."""
    from clef_vllm.bench.workloads import BenchRequest
    from clef_vllm.testing.images import data_uri, picture, video_frames as frames_of

    out = []
    for i in range(n):
        base = short[i % len(short)]
        if video_frames and i % 2:
            body = {**base.body, "videos": [frames_of((px // 2, px // 2), video_frames, seed * 1000 + i, "JPEG")]}
        else:
            body = {**base.body, "images": [data_uri(picture((px, px), seed * 1000 + i, "JPEG"), "image/jpeg")]}
        out.append(BenchRequest("images", body, json.dumps(body, separators=(",", ":")).encode(), base.questions,
                                None, label=f"images#{i}"))
    return out


#: (key, pool, concurrency, share of --load-seconds); the last phase runs until the load reaches it.
#: The images phase runs only when the pools have image requests.
PHASES = (("short1", "short", 1, 0.15), ("short16", "short", 16, 0.25), ("long", "long", 4, 0.30),
          ("images", "images", 4, 0.10), ("shared", "shared", 8, 0.30))


def _cycle(pool: list, n: int) -> list:
    return [pool[i % len(pool)] for i in range(n)]


async def _phase(url: str, name: str, reqs: list, c: int, seconds: float, timeout: float) -> tuple[dict, list]:
    from clef_vllm.bench.loadgen import HttpSender, closed_loop, summarize_point

    sender = HttpSender(url, concurrency=c, timeout=timeout)
    try:
        outcomes, wall = await closed_loop(reqs, c, sender.send, time_limit=seconds)
    finally:
        await sender.aclose()
    done = [o for o in outcomes if o is not None]
    sent = reqs[: len(outcomes)]
    point = summarize_point(name, c, [r for r, o in zip(sent, outcomes) if o is not None], done, wall)
    return point, done


async def run_load(url: str, pools: Pools, load_seconds: float, alive: Callable[[], bool], *,
                   request_timeout: float = 180.0, concurrency: dict[str, int] | None = None,
                   warm_short: int = 4, warm_shared: int = 2) -> dict:
    """The load mix against ``url``: warm-up (``warm_short`` short requests, ``warm_shared`` about the shared
    state: 2, so that a state cache admitting a state at its second sight holds it), then :data:`PHASES` (``concurrency``
    overrides a phase's by key); stops early when ``alive()`` says the server is gone. Returns the row's
    load figures and every phase's clef-bench point."""
    from clef_vllm.bench.loadgen import HttpSender, closed_loop

    warm = HttpSender(url, concurrency=1, timeout=request_timeout)
    try:
        warm_out, _ = await closed_loop(pools.short[:warm_short] + pools.shared_warm[:warm_shared], 1, warm.send)
    finally:
        await warm.aclose()
    points: list[dict] = []
    result: dict[str, Any] = {"short_p50_ms": None, "short_c16_req_per_s": None, "long_ok": None,
                              "errors": sum(1 for o in warm_out if o is not None and not o.ok),
                              "state_cache_hits": 0, "points": points, "load_error": None,
                              "image_p50_ms": None, "images_ok": None}
    t0 = time.monotonic()
    for k, (key, pool_name, c, share) in enumerate(PHASES):
        if not alive():
            break
        c = (concurrency or {}).get(key, c)
        name = f"{'shared-state' if pool_name == 'shared' else pool_name} c={c}"
        pool = getattr(pools, pool_name)
        if not pool:
            continue
        seconds = share * load_seconds
        if k == len(PHASES) - 1:
            seconds = max(seconds, load_seconds - (time.monotonic() - t0))
        # enough items that the time limit, not the pool, ends the phase (the pool repeats)
        reqs = _cycle(pool, max(len(pool), int(400 * c * max(seconds, 1.0) / (1 if pool_name == "short" else 20))))
        say(f"  load: {name} for {seconds:.0f}s")
        try:
            point, done = await asyncio.wait_for(_phase(url, name, reqs, c, seconds, request_timeout),
                                                 timeout=seconds + request_timeout + 30)
        except asyncio.TimeoutError:
            say(f"  load: {name}: no end {request_timeout + 30:.0f} s past its time limit; the load stops here")
            result["errors"] += 1
            result["load_error"] = f"{name} did not end"
            break
        points.append(point)
        bad = sum(1 for o in done if not o.ok)
        result["errors"] += bad
        result["state_cache_hits"] += point["input_tokens"]["requests_with_hits"]
        lat = point["latency_ms"]
        say(f"  load: {name}: {point['ok']}/{point['sent']} ok, {point['req_per_s']} req/s, "
            f"p50 {lat['p50'] if lat else None} ms, errors {point['errors']}, "
            f"cache hits {point['input_tokens']['requests_with_hits']}")
        if key == "short1" and lat:
            result["short_p50_ms"] = lat["p50"]
        if key == "short16":
            result["short_c16_req_per_s"] = point["req_per_s"]
        if pool_name == "long" and done:
            result["long_ok"] = bad == 0
        if pool_name == "images" and done:
            result["images_ok"], result["image_p50_ms"] = bad == 0, lat["p50"] if lat else None
    result["load_seconds"] = round(time.monotonic() - t0, 1)
    return result


# --------------------------------------------------------------------------- raw vLLM


def raw_main(a: argparse.Namespace) -> int:
    """Child: raw vLLM ``embed`` pooling (clef-bench's raw engine) of the short requests' token ids at
    ``--gpu-memory-utilization``, c=``--concurrency`` for ``--seconds``; the figures as JSON to ``--out``."""
    from clef_vllm.bench.loadgen import closed_loop, summarize_point
    from clef_vllm.bench.raw_vllm import RawVllmEngine, raw_engine_kwargs

    pools = build_pools(a.ckpt, seed=a.seed, short_tokens=a.short_tokens, n_long=0, n_shared=0, keep_ids=True)
    reqs = [r for r in pools.short if r.input_ids is not None]
    engine = RawVllmEngine(raw_engine_kwargs(a.ckpt, gpu_memory_utilization=a.gpu_memory_utilization))

    async def go() -> dict:
        await engine.start()
        print(f"raw engine ready in {engine.start_s:.1f}s", file=sys.stderr, flush=True)
        try:
            await closed_loop(reqs[:a.concurrency], a.concurrency, engine.send)            # warm-up
            items = _cycle(reqs, 400 * a.concurrency * max(int(a.seconds), 1))
            outcomes, wall = await closed_loop(items, a.concurrency, engine.send, time_limit=a.seconds)
            done = [(r, o) for r, o in zip(items, outcomes) if o is not None]
            point = summarize_point("short", a.concurrency, [r for r, _ in done], [o for _, o in done], wall)
            return {"point": point, "engine_start_s": engine.start_s}
        finally:
            engine.close()

    result = asyncio.run(go())
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    p = result["point"]
    print(f"raw vLLM short c={a.concurrency}: {p['ok']}/{p['sent']} ok, {p['req_per_s']} req/s", file=sys.stderr)
    return 0


def run_raw(ckpt: str, share: float, pools: Pools, log_path: Path, *, seconds: float = 30.0,
            concurrency: int = 16, timeout: float = 420.0) -> tuple[float | None, str | None, dict | None]:
    """Raw vLLM in a child process (alone on the emulated card): (req/s, note, its point)."""
    out = log_path.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "raw", "--ckpt", ckpt, "--gpu-memory-utilization",
           f"{share}", "--seconds", f"{seconds}", "--concurrency", str(concurrency),
           "--short-tokens", str(pools.settings["short_tokens"]), "--seed", str(pools.settings["seed"]),
           "--out", str(out)]
    proc = spawn(cmd, log_path, env=_child_env())
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        stop_group(proc, signal.SIGINT, grace=20)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if rc == 0 and out.exists():
        point = json.loads(out.read_text())["point"]
        out.unlink()
        if point["ok"]:
            return point["req_per_s"], None, point
        return None, f"raw vLLM answered none of {point['sent']} requests: {point['errors']}", point
    if rc is None:
        return None, f"raw vLLM did not finish in {timeout:.0f} s: {failure_reason(text)}", None
    started = "engine ready" in text
    what = "failed under load" if started else f"did not start at {share} of the device"
    return None, f"raw vLLM {what} (exit {rc}): {failure_reason(text)}", None


# --------------------------------------------------------------------------- one row


@dataclass
class RowConfig:
    """What one row runs. ``gpu=False`` (CPU: the reference backend) skips the ballast, NVML and the budget flag."""

    card: Card
    ckpt: str
    flags: list[str] = field(default_factory=list)
    load_format: str | None = "clef-dummy"
    load_seconds: float = 120.0
    raw: bool = False
    raw_seconds: float = 30.0
    gpu: bool = True
    log_dir: Path = Path(".")
    ready_timeout: float = READY_TIMEOUT_S
    max_model_len: int = 16384
    label: str = ""
    concurrency: dict[str, int] | None = None     # a phase's concurrency by key (PHASES), e.g. a CPU test's
    warm_short: int = 4
    warm_shared: int = 2

    @property
    def stem(self) -> str:
        tag = self.label or (re.sub(r"[^A-Za-z0-9]+", "-", " ".join(self.flags)).strip("-")[:60] if self.flags else "")
        return f"memory_budget_{self.card.slug}" + (f"_{tag}" if tag else "")


def server_command(cfg: RowConfig, share: float | None, port: int) -> tuple[list[str], str]:
    """(the command run, the command as a user types it: ``clef-systemone`` without host and port)."""
    head = ["--model", cfg.ckpt]
    if cfg.load_format:
        head += ["--load-format", cfg.load_format]
    if share is not None:
        head += ["--gpu-memory-utilization", f"{share}"]
    run = [sys.executable, "-m", "clef_vllm.server.cli", *head, "--host", "127.0.0.1", "--port", str(port), *cfg.flags]
    return run, shlex.join(["clef-systemone", *head, *cfg.flags])


def empty_row(cfg: RowConfig) -> dict:
    return {k: None for k in ROW_KEYS} | {"flags": shlex.join(cfg.flags), "started": False, "oom": False,
                                         "died": False, "log_lines": [], "errors": 0, "state_cache_hits": 0}


def _gzip(path: Path) -> Path | None:
    if not path.exists():
        return None
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return gz


def run_row(cfg: RowConfig, pools: Pools, gpu: Gpu | None = None) -> dict:
    """One row: ballast, server, NVML sampling, the load mix, stop; raw vLLM alone when asked; the ballast
    stopped whatever happens."""
    row = empty_row(cfg)
    logs = cfg.log_dir
    logs.mkdir(parents=True, exist_ok=True)
    server_log = logs / f"{cfg.stem}_server.log"
    if gpu is not None:
        row["gpu"] = gpu.name()
    ballast = Ballast(cfg.card.usable_gib, logs / f"{cfg.stem}_ballast.log") if cfg.gpu else None
    server: subprocess.Popen | None = None
    sampler = MemorySampler(gpu)
    detail: dict[str, Any] = {"card": cfg.card.key, "pools": pools.settings}
    share = None
    try:
        try:
            if ballast is not None:
                say(f"[{cfg.card.key}] ballast: " + ("probing the device" if cfg.card.full else
                                                     f"holding all but {cfg.card.usable_gib} GiB"))
                info = ballast.start()
                total_gib = info["total"] / GIB
                row["device_total_gib"] = round(total_gib, 2)
                row["gpu"] = row["gpu"] or info.get("name")
                usable = total_gib if cfg.card.full else cfg.card.usable_gib
                row["card_gib"] = round(total_gib, 2) if cfg.card.full else cfg.card.nominal
                share = VLLM_DEFAULT_SHARE if cfg.card.full else share_for(usable, total_gib)
                row["budget_gib"] = round(share * total_gib, 2)
                detail["ballast"] = info
                if cfg.card.full:
                    ballast.stop()                     # the probe exits by itself
                else:
                    say(f"[{cfg.card.key}] ballast holds {info['held'] / GIB:.2f} GiB; {info['free'] / GIB:.2f} GiB free "
                        f"of {total_gib:.2f}; server share {share} = {row['budget_gib']} GiB")
            else:
                row["card_gib"] = cfg.card.nominal
            port = free_port()
            cmd, row["command"] = server_command(cfg, share, port)
            url = f"http://127.0.0.1:{port}"
            say(f"[{cfg.card.key}] server: {row['command']}")
            sampler.start()
            server = spawn(cmd, server_log, env=_child_env())
            detail["server_pid"] = server.pid
            t0 = time.monotonic()
            while time.monotonic() - t0 < cfg.ready_timeout:
                if server.poll() is not None or healthy(url):
                    break
                time.sleep(1.0)
            row["started"] = server.poll() is None and healthy(url)
            detail["ready_s"] = round(time.monotonic() - t0, 1)
            if row["started"]:
                say(f"[{cfg.card.key}] server ready after {detail['ready_s']:.0f}s")
                try:
                    load = asyncio.run(run_load(url, pools, cfg.load_seconds, lambda: server.poll() is None,
                                                concurrency=cfg.concurrency, warm_short=cfg.warm_short,
                                                warm_shared=cfg.warm_shared))
                except Exception as exc:  # noqa: BLE001 - the row still says what the server did
                    say(f"[{cfg.card.key}] the load failed: {type(exc).__name__}: {exc}")
                    detail["load_error"] = f"{type(exc).__name__}: {exc}"[:500]
                else:
                    detail["points"] = load.pop("points")
                    detail["load_error"] = load.pop("load_error")
                    row.update({k: load[k] for k in ("short_p50_ms", "short_c16_req_per_s", "long_ok", "errors",
                                                     "state_cache_hits", "load_seconds", "image_p50_ms",
                                                     "images_ok")})
            else:
                why = f"exited with {server.returncode}" if server.poll() is not None else \
                    f"not ready after {cfg.ready_timeout:.0f}s"
                say(f"[{cfg.card.key}] server did not start ({why})")
                detail["start_failure"] = why
            row["died"] = server.poll() is not None
            if row["died"] and row["started"]:
                say(f"[{cfg.card.key}] the server exited under load (status {server.returncode})")
        finally:
            if server is not None:
                stop_group(server, signal.SIGINT, grace=30)
                say(f"[{cfg.card.key}] server stopped")
            sampler.stop()
            released = sampler.wait_released(60)
            if not released:
                say(f"[{cfg.card.key}] WARNING: the server's GPU memory is still held 60 s after it stopped")
        peak = sampler.peak_bytes
        row["peak_process_gib"] = None if peak is None else round(peak / GIB, 2)
        detail["peak_method"] = sampler.method
        detail["samples"] = sampler.samples
        text = server_log.read_text(errors="replace") if server_log.exists() else ""
        parsed = parse_server_log(text, cfg.max_model_len)
        for k in ("kv_cache_gib", "kv_tokens", "max_concurrency_16k", "plan_kv_cache_gib", "oom", "log_lines"):
            row[k] = parsed[k]
        detail["kv_source"] = parsed["kv_source"]
        detail["model_loading_gib"] = parsed["model_loading_gib"]
        if not row["started"]:
            row["log_lines"] += [ln for ln in log_tail(text) if ln not in row["log_lines"]]
        if cfg.raw:
            if not cfg.gpu or share is None:
                row["raw_note"] = "no GPU budget: raw vLLM not run"
            else:
                say(f"[{cfg.card.key}] raw vLLM at {share} of the device, c=16 for {cfg.raw_seconds:.0f}s")
                rate, note, point = run_raw(cfg.ckpt, share, pools,
                                            logs / f"{cfg.stem}_raw.log", seconds=cfg.raw_seconds)
                row["raw_short_c16_req_per_s"], row["raw_note"] = rate, note
                detail["raw_point"] = point
                say(f"[{cfg.card.key}] raw vLLM: {rate} req/s" + (f" ({note})" if note else ""))
                _gzip(logs / f"{cfg.stem}_raw.log")
    finally:
        if ballast is not None:
            ballast.stop()
            say(f"[{cfg.card.key}] ballast stopped")
        _gzip(server_log)
        (logs / f"{cfg.stem}_load.json").write_text(json.dumps(detail, indent=1) + "\n")
    return {k: row[k] for k in ROW_KEYS}


# --------------------------------------------------------------------------- results files


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not a JSON list of rows")
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(path)


def _row_key(row: dict) -> tuple:
    card, total = row.get("card_gib"), row.get("device_total_gib")
    full = card is not None and total is not None and abs(card - total) < 0.01
    return ("full" if full else card, row.get("flags") or "")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row of ``new`` replacing the one of the same card and flags (else appended)."""
    out = list(old)
    for row in new:
        keys = [_row_key(r) for r in out]
        if _row_key(row) in keys:
            out[keys.index(_row_key(row))] = row
        else:
            out.append(row)
    return out


def _f(x: Any, fmt: str, none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def card_label(row: dict) -> str:
    card, total = row.get("card_gib"), row.get("device_total_gib")
    if card is None:
        return "—"
    if total is not None and abs(card - total) < 0.01:
        name = (row.get("gpu") or "full card").replace("NVIDIA ", "")
        return f"{name}, full ({card:.2f} GiB)"
    usable = USABLE_GIB.get(f"{card:g}")
    return f"{card:g} GB" + (f" ({usable} GiB)" if usable else "")


def table(rows: list[dict]) -> str:
    """The README's "GPU memory" table: one row per result."""
    with_flags = any(r.get("flags") for r in rows)
    head = ["card", *(["flags"] if with_flags else []), "budget", "started", "KV cache", "KV tokens",
            "16k-token sequences", "peak process / budget", "short p50 (c=1)", "short c=16", "raw vLLM c=16"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        started = "yes" if r.get("started") else "no"
        if r.get("oom"):
            started += ", out of memory"
        elif r.get("died") and r.get("started"):
            started += ", exited under load"
        if r.get("errors"):
            started += f", {r['errors']} errors"
        peak = "—" if r.get("peak_process_gib") is None else \
            f"{r['peak_process_gib']:.2f} / {_f(r.get('budget_gib'), '.2f')} GiB"
        if r.get("peak_process_gib") is not None and r.get("budget_gib") is not None \
                and r["peak_process_gib"] > r["budget_gib"]:
            peak += " (over)"
        ours, raw = r.get("short_c16_req_per_s"), r.get("raw_short_c16_req_per_s")
        raw_cell = "—" if raw is None else f"{raw:.1f} req/s" + (f" ({100 * ours / raw:.0f} %)" if ours else "")
        if r.get("raw_note"):
            raw_cell += f" [{len(notes) + 1}]"
            notes.append(r["raw_note"])
        cells = [card_label(r), *([f"`{r['flags']}`" if r.get("flags") else "defaults"] if with_flags else []),
                 _f(r.get("budget_gib"), ".2f") + (" GiB" if r.get("budget_gib") is not None else ""), started,
                 _f(r.get("kv_cache_gib"), ".2f") + (" GiB" if r.get("kv_cache_gib") is not None else ""),
                 _f(r.get("kv_tokens"), ","), _f(r.get("max_concurrency_16k"), ".2f"), peak,
                 _f(r.get("short_p50_ms"), ".1f") + (" ms" if r.get("short_p50_ms") is not None else ""),
                 _f(ours, ".1f") + (" req/s" if ours is not None else ""), raw_cell]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "KV cache: the plugin's `clef memory budget` figure where it logs one, else vLLM's \"Available KV "
                "cache memory\"; 16k-token sequences: vLLM's maximum concurrency at 16,384 tokens; peak process: the "
                "server's processes by NVML, from start to stop, under the load mix; raw vLLM: embed pooling of the "
                "same token ids at the same budget, alone on the card."]
    out += [f"\n[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(out)


def _load_detail_lines(log_dir: Path, stems: Sequence[str]) -> list[str]:
    lines = []
    for stem in stems:
        path = log_dir / f"{stem}_load.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        lines.append(f"{stem}: ready after {d.get('ready_s')} s; KV from {d.get('kv_source')}; peak by "
                     f"{d.get('peak_method')} ({d.get('samples')} samples); model loading {d.get('model_loading_gib')} "
                     f"GiB" + (f"; start: {d['start_failure']}" if d.get("start_failure") else ""))
        for p in d.get("points") or []:
            lat = p.get("latency_ms") or {}
            lines.append(f"  {p['variant']:<18} {p['ok']:>5}/{p['sent']:<5} {p['req_per_s']:>8} req/s  "
                         f"p50 {lat.get('p50')} p99 {lat.get('p99')} ms  errors {p['errors']}  "
                         f"hits {p['input_tokens']['requests_with_hits']}")
    return lines


# --------------------------------------------------------------------------- commands


def _row_config(a: argparse.Namespace, card: Card, raw: bool, log_dir: Path) -> RowConfig:
    return RowConfig(card=card, ckpt=str(a.ckpt), flags=list(a.flags), load_format=a.load_format or None,
                     load_seconds=a.load_seconds, raw=raw, raw_seconds=a.raw_seconds, gpu=not a.no_gpu,
                     log_dir=log_dir, ready_timeout=a.ready_timeout, max_model_len=a.max_model_len, label=a.label)


def _pools(a: argparse.Namespace) -> Pools:
    t0 = time.monotonic()
    pools = build_pools(str(a.ckpt), seed=a.seed, short_tokens=a.short_tokens, long_tokens=a.long_tokens,
                        shared_tokens=a.shared_tokens, max_model_len=a.max_model_len, image_px=a.image_px,
                        video_frames=a.video_frames)
    say(f"requests: {len(pools.short)} short ({pools.short[0].expected_tokens} tokens), {len(pools.long)} long "
        f"({pools.long[0].expected_tokens}), {len(pools.shared)} shared-state ({pools.shared[0].expected_tokens}) "
        f"in {time.monotonic() - t0:.1f}s")
    return pools


def _gpu(a: argparse.Namespace) -> Gpu | None:
    return None if a.no_gpu else Gpu(a.device_index)


def _say_leftovers(gpu: Gpu | None) -> None:
    """Processes already on the GPU (an earlier run's?) take from what the ballast can leave the card."""
    if gpu is None:
        return
    procs = gpu.processes()
    if procs:
        say("WARNING: the GPU already has compute processes: " + ", ".join(
            f"pid {p} ({'?' if m is None else f'{m / GIB:.2f}'} GiB)" for p, m in procs)
            + f"; {gpu.used_bytes() / GIB:.2f} GiB used")


def cmd_run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    card = parse_card(a.card)
    pools = _pools(a)
    gpu = _gpu(a)
    _say_leftovers(gpu)
    row = run_row(_row_config(a, card, a.raw, Path(a.log_dir) if a.log_dir else out.parent), pools, gpu)
    write_rows(out, read_rows(out) + [row])
    say(f"row appended to {out}")
    print(table([row]))
    return 0 if row["started"] else 1


def cmd_matrix(a: argparse.Namespace) -> int:
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(a.log_dir)
    results = out_dir / RESULTS_NAME
    cards = [parse_card(c) for c in a.cards.split(",") if c.strip()]
    raw_at = {parse_card(c).key for c in a.raw_at.split(",") if c.strip()} if a.raw_at else set()
    rows = merge_rows(read_rows(Path(a.merge)) if a.merge else [], read_rows(results))
    gpu = _gpu(a)
    _say_leftovers(gpu)
    pools = _pools(a)
    stems, timeline = [], [f"driver: {shlex.join(sys.argv)}"]

    def estimate_s(card: Card) -> float:
        raw = a.start_estimate + a.raw_seconds + 15 if card.key in raw_at else 0
        return a.start_estimate + a.load_seconds + 30 + raw

    say("plan: " + ", ".join(f"{c.key}{' + raw vLLM' if c.key in raw_at else ''} (~{estimate_s(c):.0f} s)" for c in cards)
        + f": ~{sum(map(estimate_s, cards)):.0f} s" + (f" (--time-budget {a.time_budget:.0f} s)" if a.time_budget else ""))
    for card in cards:
        raw = card.key in raw_at
        estimate = estimate_s(card)
        spent = time.monotonic() - _T0
        if a.time_budget and spent + estimate > a.time_budget:
            msg = f"[{card.key}] skipped: {spent:.0f} s spent + ~{estimate:.0f} s for this row > --time-budget"
            say(msg)
            timeline.append(msg)
            continue
        cfg = _row_config(a, card, raw, log_dir)
        t0 = time.monotonic()
        timeline.append(f"[{card.key}] start at +{t0 - _T0:.0f}s")
        try:
            row = run_row(cfg, pools, gpu)
        except Exception as exc:  # noqa: BLE001 - e.g. the ballast could not hold its share: the next card
            msg = f"[{card.key}] failed: {type(exc).__name__}: {exc}"
            say(msg)
            timeline.append(msg)
            continue
        stems.append(cfg.stem)
        timeline.append(f"[{card.key}] done in {time.monotonic() - t0:.0f}s: started {row['started']}, oom {row['oom']}, "
                        f"KV {row['kv_cache_gib']} GiB, peak {row['peak_process_gib']} / {row['budget_gib']} GiB")
        rows = merge_rows(rows, [row])
        write_rows(results, rows)                  # after every row: a run cut short keeps what it finished
        _pack(out_dir, log_dir, rows, timeline, stems)
    _pack(out_dir, log_dir, rows, timeline, stems)
    say(f"results: {results}, {out_dir / 'memory_budget_logs.tar.gz'}, {out_dir / 'memory_budget.txt'}")
    print(table(rows))
    return 0


def _pack(out_dir: Path, log_dir: Path, rows: list[dict], timeline: list[str], stems: list[str]) -> None:
    """The tar.gz of every log in ``log_dir`` and the short summary (table, timeline, each phase)."""
    with tarfile.open(out_dir / "memory_budget_logs.tar.gz", "w:gz") as tar:
        for p in sorted(log_dir.glob("memory_budget_*")):
            tar.add(p, arcname=f"memory_budget_logs/{p.name}")
    summary = [table(rows), "", *timeline, "", *_load_detail_lines(log_dir, stems)]
    (out_dir / "memory_budget.txt").write_text("\n".join(summary) + "\n")


def cmd_table(a: argparse.Namespace) -> int:
    print(table(read_rows(Path(a.file))))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, type=Path, help="checkpoint folder (bench/make_ckpt.py 9b DIR --hybrid 17)")
    p.add_argument("--load-seconds", type=float, default=120.0, help="the load mix's length per card (default 120)")
    p.add_argument("--raw-seconds", type=float, default=30.0, help="raw vLLM's c=16 measurement (default 30)")
    p.add_argument("--load-format", default="clef-dummy", help="the server's --load-format ('' = not passed)")
    p.add_argument("--short-tokens", type=int, default=360)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--shared-tokens", type=int, default=15872, help="the shared state's tokens (default 15872)")
    p.add_argument("--max-model-len", type=int, default=16384, help="the server's (only read, for the figures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-px", type=int, default=0,
                   help="an images phase: short requests with one PICTURE-px square JPEG each (2048: the 16 GB card's "
                        "largest; default 0 = none; a --text-only server answers them 400)")
    p.add_argument("--video-frames", type=int, default=0,
                   help="with --image-px: every other request of the images phase carries a video of that many JPEG "
                        "frames of half the picture's side instead (8 with 2048: 4,096 vision tokens, as the picture)")
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    p.add_argument("--device-index", type=int, default=None, help="NVML index (default: CUDA_VISIBLE_DEVICES' first, else 0)")
    p.add_argument("--label", default="", help="a tag in the log names (default: from the flags)")
    p.add_argument("--no-gpu", action="store_true",
                   help="no ballast, no NVML, no --gpu-memory-utilization (the CPU reference backend: tests)")
    p.add_argument("flags", nargs="*", help="server flags after --, e.g. -- --nvfp4-kernel vllm (default: none)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("ballast", help="hold all of the GPU's memory but CARD GiB until killed")
    g = b.add_mutually_exclusive_group(required=True)
    g.add_argument("--card", type=float, help="GiB to leave free (what the emulated card gives CUDA)")
    g.add_argument("--probe", action="store_true", help="print the device's CUDA total and exit")

    r = sub.add_parser("run", help="one row, appended to --out")
    r.add_argument("--card", required=True, help="16, 24, 32, full, or NOMINAL=USABLE_GIB")
    r.add_argument("--out", required=True, help="results file (a JSON list; the row is appended)")
    r.add_argument("--raw", action="store_true", help="also raw vLLM at the same budget, after the server")
    r.add_argument("--log-dir", default=None, help="where the logs go (default: --out's folder)")
    _common(r)

    m = sub.add_parser("matrix", help="rows for several cards, one after the other")
    m.add_argument("--cards", default="16,24,32,full")
    m.add_argument("--raw-at", default="24", help="the card(s) that get the raw vLLM comparison ('' = none)")
    m.add_argument("--out-dir", required=True,
                   help=f"{RESULTS_NAME} (rows merged with one already there), memory_budget_logs.tar.gz, "
                        "memory_budget.txt")
    m.add_argument("--log-dir", default="/tmp/clef-memory-budget/logs",
                   help="the logs (packed into the tar.gz; default /tmp/clef-memory-budget/logs)")
    m.add_argument("--merge", default=None, help="start from this results file's rows (an earlier call's)")
    m.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="skip a row that would end past S seconds from the start (by --start-estimate)")
    m.add_argument("--start-estimate", type=float, default=75.0,
                   help="seconds a server (or raw vLLM) start takes, for --time-budget (default 75)")
    _common(m)

    t = sub.add_parser("table", help="the README's GPU memory table from a results file")
    t.add_argument("file")

    w = sub.add_parser("raw", help=argparse.SUPPRESS)
    w.add_argument("--ckpt", required=True)
    w.add_argument("--gpu-memory-utilization", type=float, required=True)
    w.add_argument("--seconds", type=float, default=30.0)
    w.add_argument("--concurrency", type=int, default=16)
    w.add_argument("--short-tokens", type=int, default=360)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "ballast":
        return ballast_main(a.card, a.probe)
    if a.command == "table":
        return cmd_table(a)
    if a.command == "raw":
        return raw_main(a)
    install_signal_handlers()
    if a.flags and a.flags[0] == "--":
        a.flags = a.flags[1:]
    try:
        return cmd_run(a) if a.command == "run" else cmd_matrix(a)
    finally:
        _cleanup_all()


if __name__ == "__main__":
    sys.exit(main())
