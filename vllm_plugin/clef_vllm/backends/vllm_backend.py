"""vLLM backend: an ``AsyncLLM`` pooling engine (data parallel through vLLM itself) with the
joint head inside the worker (``ClefPooler``).

The front-end encodes requests with the shared encoder and hands vLLM token ids plus a head
spec (``PoolingParams(task="plugin", extra_kwargs={"clef": ...})``, names in
:mod:`clef_vllm.contract`); the worker returns only the per-option probabilities. The engine lives
on a private event-loop thread so the offline API (blocking) and the server (asyncio) share one
code path. Options: :class:`clef_vllm.backends.options.VllmOptions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from clef_vllm.backends.base import Backend, BackendDeadError
from clef_vllm.backends.engine_settings import remote_ranks
from clef_vllm.backends.engine_shutdown import shutdown_engine
from clef_vllm.backends.memory_fit import fit_options
from clef_vllm.backends.options import VllmOptions, backend_options, engine_args
from clef_vllm.backends.rank_watchdog import RankWatchdog
from clef_vllm.backends.vllm_media import (engine_media_limits, image_warmup, media_prompt, media_settings, sees,
                                          video_tokens)
from clef_vllm.contract import PARAMS_KEY, POOLING_TASK, SETTINGS_KEY, WorkerSettings
from clef_vllm.model.checkpoint import load_head_config, locate_checkpoint
from clef_vllm.model.features import HeadSpec
from clef_vllm.model.layout import ARCHITECTURE
from clef_vllm.schema.encoding import EncodedRequest, RequestEncoder
from clef_vllm.schema.media import media_refused
from clef_vllm.schema.state_keys import KEY_UNIT, MIN_REUSE_TOKENS
from clef_vllm.util import trace
from clef_vllm.util.stacks import dump_descendant_stacks
from clef_vllm.worker.dummy_loader import is_dummy

log = logging.getLogger("clef_vllm")

#: Engine settings that are not up to the user (docs/vllm-internals.md says why each is needed;
#: vLLM's own defaults differ between versions, so every one is passed explicitly).
FIXED_ENGINE_SETTINGS = dict(
    runner="pooling",
    tensor_parallel_size=1,
    enable_chunked_prefill=True,      # the pooler is chunk-aware
    mamba_ssm_cache_dtype="float32",  # GDN state across chunks in fp32 (the release config's mamba_ssm_dtype)
    # The worker runs inside its engine-core process, with data parallelism too (vLLM would start a
    # separate worker process per DP engine): the scheduler must see the worker's state-cache pool.
    distributed_executor_backend="uni",
    disable_log_stats=True,
)
VLLM_MISSING = ("the vLLM backend needs vLLM 0.28 (a CUDA GPU machine): pip install './vllm_plugin[vllm]' "
                "from a clef-vllm checkout, or pip install 'clef-vllm[vllm]'")


def import_vllm():
    """``import vllm``; without it, an ImportError that says which extra to install."""
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":
            raise
        raise ModuleNotFoundError(VLLM_MISSING, name="vllm") from None
    return vllm


#: How long a request waits for another one computing the same state before computing it too.
FOLLOWER_WAIT_S = 30.0
#: One warm-up step (a prompt alone, or a batch) that takes longer than this means a stuck engine: the
#: engine processes are asked for their thread stacks (SIGUSR1, :mod:`clef_vllm.util.stacks`) and the start
#: fails naming the step, instead of /health never turning 200. Generous: it includes Triton's JIT and
#: the prefill graphs' capture on a fresh machine.
WARMUP_STEP_TIMEOUT_S = 180.0
#: States answered lately (their requests no longer lead: the state is expected in the cache).
RECENT_STATES = 4096


class EngineError(RuntimeError):
    """The engine returned something other than the expected per-option probabilities."""


def warmup_lengths(kwargs: dict) -> list[int]:
    """Prompt lengths the warm-up runs one at a time, for an engine made with ``kwargs``
    (:func:`engine_kwargs`): every prefill-graph bucket (each captures its graphs; the first prompt
    captures all head graphs), lengths that are
    and are not multiples of 16 (Triton specialises on that), and one longer than a step's token
    budget (a chunked prefill). With step graphs (``--prefill-graph-scope step``) every bucket runs
    three times: its GDN graphs are captured, then its step graph, then the step graph replays."""
    graphs = WorkerSettings.from_plain((kwargs.get("additional_config") or {}).get(SETTINGS_KEY) or {}).prefill_graphs
    buckets = graphs.buckets if graphs is not None else ()
    budget = kwargs["max_num_batched_tokens"]
    wanted = {17, 64, 300, 1024, 4096, budget + 17, *buckets}
    lengths = sorted({min(n, kwargs["max_model_len"]) for n in wanted})
    if graphs is not None and graphs.scope == "step":   # a bucket's second prompt captures its step graph, the third replays it
        lengths = sorted(lengths + 2 * [b for b in buckets if b <= kwargs["max_model_len"]])
    return lengths


#: The state cache's warm-up round: a keyed state of this many tokens, then tails of WARMUP_TAIL tokens.
WARMUP_STATE, WARMUP_TAIL = 1040, 600


def warmup_state_cache(kwargs: dict) -> tuple[int, int] | None:
    """``(state, tail)`` token counts of the warm-up's state-cache round, for an engine made with
    ``kwargs``: two prompts that share a keyed state, so the first is cached (split at the state's end)
    and the second hits it. Their last steps run past a KV block boundary (blocks are at most
    ``WARMUP_TAIL`` tokens for the shapes we serve: 528 at 9B), so the GDN state is copied between
    blocks: vLLM's copy kernel compiles here, not at the first follow-up a client sends. ``None``
    with the state cache off or a context too short for the round."""
    if not kwargs.get("enable_prefix_caching"):
        return None
    if WARMUP_STATE + WARMUP_TAIL > kwargs["max_model_len"]:
        return None
    return WARMUP_STATE, WARMUP_TAIL


def warmup_batches(kwargs: dict) -> list[list[int]]:
    """Prompt lengths of the warm-up's concurrent batches, after :func:`warmup_lengths`: a full batch of
    300-token prompts (up to 32) and a mixed one (vLLM's eager path with several sequences)."""
    return [[300] * min(32, kwargs["max_num_seqs"]), [97, 256, 411]]


def engine_input(ids: list[int]) -> dict:
    """A prompt of token ids in vLLM's rendered form (``{"type": "token", ...}``). AsyncLLM processes it
    in line; a raw ``TokensPrompt`` would take a hop through the renderer's thread pool (and vLLM's
    deprecated raw-prompt path) for nothing, since there is no text to tokenize."""
    from vllm.inputs import tokens_input

    return tokens_input(ids)


def pooling_params(spec: HeadSpec, reads: bool = False):
    """vLLM's pooling parameters of one Clef request. ``reads``: it may start from vLLM's prefix cache
    (state cache on, reusable prefix keyed); otherwise it skips reading it, as every per-token pooling
    request must when no side store holds the skipped tokens' memory rows."""
    from vllm import PoolingParams

    return PoolingParams(task=POOLING_TASK, extra_kwargs={PARAMS_KEY: spec.to_wire()},
                         skip_reading_prefix_cache=not reads)


async def bounded_warmup_step(what: str, step, timeout_s: float | None = None):
    """Await one warm-up ``step``; past ``timeout_s`` (default :data:`WARMUP_STEP_TIMEOUT_S`) the engine
    processes dump their thread stacks into the log and :class:`EngineError` names the step, as it does
    when the step fails with one (a wrong or non-finite answer)."""
    limit = WARMUP_STEP_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(step, limit)
    except EngineError as exc:
        raise EngineError(f"warm-up: {what}: {exc}") from exc
    except asyncio.TimeoutError:
        pids = dump_descendant_stacks()
        where = f"the thread stacks of engine processes {pids} follow in the log" if pids else "no engine process found"
        log.error("warm-up: %s did not finish within %.0f s; %s", what, limit, where)
        raise EngineError(f"warm-up: {what} did not finish within {limit:.0f} s (a stuck engine; {where})") from None


def remember(recent: OrderedDict, key: bytes, limit: int = RECENT_STATES) -> None:
    """Put ``key`` last in the LRU ``recent``, keeping at most ``limit`` keys."""
    recent[key] = None
    recent.move_to_end(key)
    while len(recent) > limit:
        recent.popitem(last=False)


class StateAffinity:
    """Which data-parallel engine a state-keyed request goes to: the one its state hashes to, unless
    that engine has ``slack`` more such requests in flight than the least busy one (then that one,
    so one hot state cannot hold a whole engine while the others idle). ``None`` with one engine."""

    def __init__(self, engines: int, slack: int = 8):
        self.engines = engines
        self.slack = slack
        self.in_flight = [0] * engines

    def pick(self, state_key: bytes) -> int | None:
        if self.engines <= 1:
            return None
        home = int.from_bytes(state_key[:8], "little") % self.engines
        least = min(range(self.engines), key=self.in_flight.__getitem__)
        rank = home if self.in_flight[home] - self.in_flight[least] < self.slack else least
        self.in_flight[rank] += 1
        return rank

    def release(self, rank: int | None) -> None:
        if rank is not None:
            self.in_flight[rank] -= 1


def linear_method(files, opts: VllmOptions) -> str | None:
    """What the backbone's linear layers run: the checkpoint's quantization method, else the online one
    (``--quantization``), else ``None`` (unquantized BF16)."""
    return (files.quantization_config or {}).get("quant_method") or opts.quantization


def engine_kwargs(model_dir: str | Path, options: VllmOptions | None = None, **kwargs: Any) -> dict:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for a Clef checkpoint (explicit, version-stable):
    :data:`FIXED_ENGINE_SETTINGS` + what the options produce (:func:`~clef_vllm.backends.options.engine_args`).
    Unset prefill-graph buckets become the defaults of the checkpoint's linear kernels
    (:func:`~clef_vllm.worker.fast.prefill_graphs.default_buckets`)."""
    opts = options if options is not None else backend_options("vllm", kwargs)
    files = locate_checkpoint(model_dir, require_weights=not is_dummy(opts.load_format))
    if opts.prefill_graphs and opts.prefill_graph_buckets is None:
        from clef_vllm.worker.fast.prefill_graphs import default_buckets

        opts = replace(opts, prefill_graph_buckets=default_buckets(linear_method(files, opts)))
    architectures = files.config.get("architectures") or []
    out = dict(FIXED_ENGINE_SETTINGS)
    out["model"] = str(files.root)
    out.update(engine_args(opts))
    out.update(media_settings(files, opts))
    if ARCHITECTURE not in architectures:
        # The Cloudflare release says Qwen3_5ForConditionalGeneration: serve it as our class.
        out["hf_overrides"] = {"architectures": [ARCHITECTURE]}
    return out


class VllmBackend(Backend):
    """AsyncLLM + ClefPooler. Use ``decide`` from asyncio or ``decide_batch`` from plain code."""

    name = "vllm"
    #: CLEF_VLLM_PROFILE's window (set in ``__init__``; off for instances made without it, as tests make them)
    _profile: trace.ProfileWindow | None = None
    #: the remote ranks' liveness probes (``--rank-watchdog-s``), and why they declared a rank dead
    _watchdog: RankWatchdog | None = None
    _rank_failure: str | None = None
    #: whether the engine takes media (False: text only); the most vision tokens a video may make (None: no cap)
    _sees: bool = False
    _video_tokens: int | None = None

    def __init__(self, model_dir: str | Path, options: VllmOptions | None = None, *,
                 encoder: RequestEncoder | None = None, **kwargs: Any):
        """``options`` (or the same as keyword arguments): :class:`~clef_vllm.backends.options.VllmOptions`. The
        memory plan keeps the keyword arguments given (not ``None``) as the operator set them."""
        given = frozenset(k for k, v in kwargs.items() if v is not None)
        self.options = options if options is not None else backend_options("vllm", kwargs)
        import_vllm()   # fail early, naming the extra to install

        from clef_vllm.plugin import register

        register()
        self.files = locate_checkpoint(model_dir, require_weights=not is_dummy(self.options.load_format))
        load_head_config(self.files)  # version marker, checked in the front-end too
        self.options, self.memory_plan = fit_options(self.files.root, self.options, given=given)  # PlanDoesNotFit
        self.max_model_len = self.options.max_model_len
        refusal = (None if sees(self.files, self.options) else "the server runs with --text-only"
                   if self.options.text_only else "the checkpoint has no vision tower and image processor")
        self.encoder = encoder or RequestEncoder.from_pretrained(self.files.root, max_length=self.max_model_len,
                                                                 images=refusal, pixels=False)
        self._sees = self.encoder.media is not None
        self._video_tokens = video_tokens(self.encoder.media, self.options)
        self.kwargs = engine_kwargs(self.files.root, self.options)
        self.warmup_enabled = self.options.warmup
        self.state_cache = bool(self.kwargs.get("enable_prefix_caching"))
        self.admit_on_repeat = self.options.state_cache_admit == "repeat"
        self.affinity = StateAffinity(int(self.kwargs["data_parallel_size"]))
        self._leaders: dict[bytes, asyncio.Future] = {}
        self._recent_states: OrderedDict[bytes, None] = OrderedDict()   # states computed with their keys lately
        self._sightings: OrderedDict[bytes, None] = OrderedDict()       # states seen once, not cached
        self._ids = itertools.count()
        self._profile = trace.ProfileWindow.from_env()     # CLEF_VLLM_PROFILE (diagnosis; off by default)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clef-vllm-engine", daemon=True)
        self._thread.start()
        self.engine = None
        self.kernels: dict = {}
        self._submit(self._start()).result()

    # ------------------------------------------------------------------ engine lifecycle

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        if torch.cuda.is_initialized() and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            # Engine processes cannot be forked from a process that already holds a CUDA context.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        kwargs = dict(self.kwargs)
        if self._profile is not None:
            from vllm.config import ProfilerConfig

            kwargs["profiler_config"] = ProfilerConfig(**self._profile.profiler_config())
        args = AsyncEngineArgs(**kwargs)
        if self.options.engine_core == "thread":
            from clef_vllm.backends.inproc import ThreadedEngine

            self.engine = ThreadedEngine.from_engine_args(args, self._loop, UsageContext.OPENAI_API_SERVER)
            log.info("vLLM engine core in this process, stepped by a thread (--engine-core thread)")
        else:
            self.engine = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER)
            trace.instrument(self.engine)
        tasks = await self.engine.get_supported_tasks()
        if POOLING_TASK not in tasks:
            raise EngineError(f"engine supports {tasks}, not the {POOLING_TASK!r} pooling task: is the clef plugin "
                              "loaded?")
        log.info("vLLM engine up in %.1f s (dp=%s, max_model_len=%d, max_num_batched_tokens=%d)",
                 time.perf_counter() - t0, self.kwargs["data_parallel_size"], self.kwargs["max_model_len"],
                 self.kwargs["max_num_batched_tokens"])
        self._report_kernels()
        if self.warmup_enabled:
            await self._warmup()
        self._watch_remote_ranks()

    def _watch_remote_ranks(self) -> None:
        """Start the liveness probes of the ranks on ``--headless`` nodes (:mod:`clef_vllm.backends.rank_watchdog`;
        vLLM's head sees only its own node's engine processes die). Runs on the engine loop."""
        ranks = remote_ranks(self.options)
        if not ranks or not self.options.rank_watchdog_s:
            return
        client = getattr(self.engine, "engine_core", None)
        if not RankWatchdog.supported(client):
            log.warning("rank watchdog off: vLLM's client (%s) cannot address one engine", type(client).__name__)
            return
        self._watchdog = RankWatchdog(client, ranks, self._rank_dead, self.options.rank_watchdog_s)
        self._watchdog.start()

    def _rank_dead(self, rank: int, reason: str) -> None:
        self._rank_failure = reason

    def _report_kernels(self) -> None:
        """Say, per quantization scheme, which kernel runs on this GPU (never pretend).

        This is the front-end's prediction from the checkpoint config (clef_vllm.quant); each
        worker also logs the kernels it actually instantiated ("clef kernels in use")."""
        from clef_vllm.quant.kernels import cuda_capability, predict_kernel
        from clef_vllm.quant.schemes import FP8_W8A8, NVFP4_W4A4, UNQUANTIZED, scheme_table, summarize_schemes

        cap = cuda_capability()
        backend = self.kwargs.get("linear_backend", "auto")
        online = self.kwargs.get("quantization")
        if self.files.quantization_config is None:
            kinds = {FP8_W8A8 if online == "fp8" else UNQUANTIZED: None}
        else:
            try:
                kinds = summarize_schemes(scheme_table(self.files.config))
            except Exception as exc:  # noqa: BLE001 - a report must never stop the server
                log.warning("could not resolve quantization schemes: %s", exc)
                return
        if self.options.nvfp4_kernel == "bf16" and NVFP4_W4A4 not in kinds:
            log.warning("--nvfp4-kernel %s changes nothing here: this checkpoint has no NVFP4 W4A4 layers",
                        self.options.nvfp4_kernel)
        lines = []
        for kind, count in kinds.items():
            where = f" ({count} modules)" if count else (" (online FP8)" if online else "")
            if cap is None:
                lines.append(f"{kind}{where}: no CUDA GPU visible to the front-end")
                continue
            pred = predict_kernel(kind, cap, linear_backend=backend, nvfp4_kernel=self.options.nvfp4_kernel)
            lines.append(f"{kind}{where}: {pred.kernel} [{pred.numerics}] - {pred.description}")
        self.kernels = {"capability": cap, "lines": lines, "summary": {k: v for k, v in kinds.items()}}
        for line in lines:
            log.info("kernels: %s", line)

    async def _warmup(self) -> None:
        """Run the shapes the server will see (Triton JIT, prefill and head graphs, head paths) before /health
        says ready: each length alone, then concurrent batches of mixed lengths."""
        t0 = time.perf_counter()
        vocab = int(self.files.text_config.get("vocab_size", 1024))
        lengths = warmup_lengths(self.kwargs)
        rng = torch.Generator().manual_seed(0)

        def ids(n):
            return torch.randint(0, vocab, (n,), generator=rng).tolist()

        for n in lengths:
            await bounded_warmup_step(f"a {n}-token prompt", self._run_ids(ids(n)))
        batches = warmup_batches(self.kwargs)
        for batch in batches:
            await bounded_warmup_step(f"a batch of {len(batch)} prompts ({sorted(set(batch))} tokens)",
                                      asyncio.gather(*[self._run_ids(ids(n)) for n in batch]))
        if self._sees:                               # the vision tower's kernels, vLLM's image processor
            prompt, with_image = image_warmup(self.encoder.media, ids(200))
            await bounded_warmup_step("a prompt with an image", self._run_ids(with_image, prompt=prompt))
        round_ = warmup_state_cache(self.kwargs)
        if round_ is not None:
            state, tail = round_
            shared = ids(state)
            for which in ("cached", "hit"):
                await bounded_warmup_step(f"a {state}-token state with a {tail}-token tail ({which})",
                                          self._run_ids(shared + ids(tail), reuse=state))
        log.info("warm-up done in %.1f s (lengths %s, then batches of %s prompts%s)", time.perf_counter() - t0,
                 lengths, [len(b) for b in batches], ", then a state cached and hit" if round_ else "")

    async def _run_ids(self, ids: list[int], reuse: int = 0, prompt: dict | None = None) -> torch.Tensor:
        """A warm-up prompt with a synthetic spec; ``reuse``: its first tokens are a state to key (state cache);
        ``prompt``: vLLM's form of it, when not its ids (one with an image)."""
        from clef_vllm.model.features import synthetic_spec

        spec = synthetic_spec(len(ids))
        if reuse:
            spec = spec.with_reuse(ids, reuse)
        return (await self._encode(prompt or engine_input(ids), ids, spec, warmup=True))[0]

    # ------------------------------------------------------------------ requests

    async def _encode(self, prompt: dict, ids: list[int], spec: HeadSpec, rank: int | None = None,
                      use_cache: bool = True, warmup: bool = False) -> tuple[torch.Tensor, int]:
        """Per-option probabilities of one prompt (vLLM's form of it, and the ``ids`` the engine must end up with),
        and how many of its tokens came from the state cache (``warmup``: a warm-up prompt, so marked in the
        trace)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        from clef_vllm.backends.inproc import EngineThreadError

        reads = self.state_cache and use_cache and bool(spec.state_keys)
        params = pooling_params(spec, reads=reads)
        request_id = f"clef-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        engine = self.engine
        if engine is None:
            raise BackendDeadError("the vLLM engine is not running")
        if self._rank_failure is not None:
            raise BackendDeadError(self._rank_failure)
        # Cancelling this coroutine (server timeout, client gone) aborts the request in the engine
        # core; an engine-core death surfaces as EngineDeadError.
        trace.event("submit", request_id, tokens=len(ids), **({"warmup": True} if warmup else {}))
        profiled = contextlib.nullcontext() if warmup or self._profile is None else self._profile.around(engine)
        async with profiled:
            try:
                final = await self._final_output(engine, prompt, params, request_id, rank)
            except (EngineDeadError, EngineThreadError) as exc:     # its process, or its thread (--engine-core)
                raise BackendDeadError(f"vLLM engine core died: {exc}") from exc
        if final is None:
            raise EngineError("engine returned no output")
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        trace.event("answer", request_id, cached=cached)
        if list(final.prompt_token_ids) != ids:
            raise EngineError("vLLM's prompt token ids differ from the encoded request (spans would be wrong)")
        data = final.outputs.data
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data)
        data = data.float().reshape(-1)
        if data.numel() != spec.num_options or not bool(torch.isfinite(data).all()):
            if cached and reads:
                log.warning("request %s: no answer from the %d cached tokens (state cache rows missing); "
                            "recomputing it without the cache", request_id, cached)
                return await self._encode(prompt, ids, spec, rank, use_cache=False)
            if data.numel() != spec.num_options:
                raise EngineError(f"engine returned {data.numel()} values for {spec.num_options} options")
            raise EngineError(f"engine returned non-finite values for {int((~torch.isfinite(data)).sum())} of "
                              f"{spec.num_options} options")
        return data, cached

    @staticmethod
    async def _final_output(engine, prompt, params, request_id: str, rank: int | None):
        """The last output of one pooling request; ``rank`` pins it to a data-parallel engine
        (``AsyncLLM.encode`` has no such argument, so this mirrors it on ``add_request``)."""
        final = None
        if rank is None:
            async for out in engine.encode(prompt, params, request_id=request_id):
                final = out
            return final
        from vllm.v1.engine.exceptions import EngineDeadError

        queue = await engine.add_request(request_id, prompt, params, data_parallel_rank=rank)
        try:
            while final is None or not final.finished:
                final = queue.get_nowait() or await queue.get()
        except (asyncio.CancelledError, Exception) as exc:
            if not isinstance(exc, EngineDeadError):
                await engine.abort(queue.request_id, internal=True)
            raise
        finally:
            queue.close()
        return final

    def _prompt(self, encoded: EncodedRequest) -> dict:
        """vLLM's prompt of an encoded request: its ids, or with media one pad per item and the media."""
        if encoded.media is None:
            return engine_input(encoded.input_ids)
        if not self._sees:           # an encoder with an image processor, an engine without: never run pads as text
            raise media_refused(self.encoder.text_only)
        return media_prompt(encoded, self.options.largest_image_pixels, self._video_tokens)

    def media_limits(self, limits):
        return engine_media_limits(limits, self.options)

    async def _decide(self, encoded: EncodedRequest) -> torch.Tensor:
        prompt = self._prompt(encoded)
        # A state with images is kept however short, from its first request, and up to the state's end (its
        # prefill stops there, so any other questions resume from it): the vision encoder's work and the image
        # tokens' prefill are what a second question about the same picture would otherwise redo.
        media = encoded.media is not None
        keyed = self.state_cache and encoded.schema_offset >= (KEY_UNIT if media else MIN_REUSE_TOKENS)
        spec = HeadSpec.from_encoded(encoded, state_keys=keyed, upto=encoded.schema_offset if media else None)
        state_key = spec.state_keys[encoded.schema_offset // KEY_UNIT - 1] if keyed and spec.state_keys else None
        if state_key is not None and self.admit_on_repeat and not media and self._first_sighting(state_key):
            # Caching a state costs its request one more step (split at the reuse boundary); a state
            # seen once may never come back, so its first request runs whole and only a repeat keeps it.
            spec, state_key = replace(spec, reuse_limit=0, state_keys=()), None
        if state_key is None:
            probs, cached = await self._encode(prompt, encoded.input_ids, spec)
        else:
            probs, cached = await self._decide_keyed(prompt, encoded, spec, state_key)
        encoded.cached_state_tokens = cached
        return probs

    async def _decide_keyed(self, prompt: dict, encoded: EncodedRequest, spec: HeadSpec, state_key: bytes):
        """A request whose state may be cached goes to the data-parallel engine that holds that state.
        The first request of a state not seen lately leads: others arriving meanwhile wait for it (up
        to :data:`FOLLOWER_WAIT_S`) and then read the state from the cache instead of computing it
        a second time alongside it."""
        leader = self._leaders.get(state_key)
        mine = False
        if leader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(leader), FOLLOWER_WAIT_S)
            except asyncio.TimeoutError:
                pass
        elif state_key not in self._recent_states:
            leader = self._leaders[state_key] = asyncio.get_running_loop().create_future()
            mine = True
        rank = self.affinity.pick(state_key)
        try:
            result = await self._encode(prompt, encoded.input_ids, spec, rank)
        finally:
            self.affinity.release(rank)
            if mine:
                leader.set_result(None)
                del self._leaders[state_key]
        remember(self._recent_states, state_key)
        return result

    def _first_sighting(self, state_key: bytes) -> bool:
        """Whether no request about this state was seen lately (cached, in flight, or a first one that
        was not cached); either way it is seen now."""
        if state_key in self._recent_states or state_key in self._leaders or state_key in self._sightings:
            return False
        remember(self._sightings, state_key)
        return True

    async def decide(self, encoded: EncodedRequest) -> torch.Tensor:
        return await asyncio.wrap_future(self._submit(self._decide(encoded)))

    def decide_batch(self, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        async def run_all():
            return await asyncio.gather(*[self._decide(e) for e in encoded])

        return list(self._submit(run_all()).result())

    def check_health(self) -> None:
        """Dead when AsyncLLM says so (engine core process gone, output handler stopped), when the rank
        watchdog declared a remote rank dead, or when our engine loop thread stopped; cheap enough to poll
        every second."""
        engine = self.engine
        if engine is not None and engine.errored:
            raise BackendDeadError("vLLM engine core died (AsyncLLM.errored); see the engine log above")
        if self._rank_failure is not None:
            raise BackendDeadError(self._rank_failure)
        if not self._thread.is_alive():
            raise BackendDeadError("the vLLM engine loop thread stopped")

    def event_loops(self) -> dict[str, asyncio.AbstractEventLoop]:
        """The engine thread's loop: AsyncLLM's output handling and every request's engine call run on it."""
        return {"engine": self._loop}

    def suggested_max_in_flight(self) -> int:
        """vLLM's own concurrency: max_num_seqs per engine, times the data-parallel engines."""
        return int(self.kwargs["max_num_seqs"]) * int(self.kwargs["data_parallel_size"])

    def describe(self) -> dict:
        return {"backend": self.name, "layout": self.files.layout, "dtype": self.options.dtype,
                "head_dtype": self.options.resolved_head_dtype, "max_model_len": self.max_model_len,
                "data_parallel_size": self.kwargs["data_parallel_size"],
                "quantization": linear_method(self.files, self.options),
                "kernels": self.kernels.get("summary")}

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stopped = True               # no verdict while the engine shuts down
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._watchdog.stop)
        if self.engine is not None:
            engine, self.engine = self.engine, None
            if self._profile is not None and self._profile.running and self._loop.is_running():
                try:                        # a profile window the traffic left open still gets written
                    self._submit(self._profile.finish(engine)).result(timeout=120)
                except Exception as exc:  # noqa: BLE001
                    log.warning("CLEF_VLLM_PROFILE at shutdown: %s", exc)
            shutdown_engine(engine, self._loop)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

