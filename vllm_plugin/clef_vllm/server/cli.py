"""``clef-systemone``: serve a Clef checkpoint over SystemOne (``POST /v1/systemone``) and OpenAI's
Decisions API (``POST /v1/decisions``).

Without ``--model`` it serves the generated demo checkpoint (built on first use) on the backend
``auto`` picks: vLLM when a CUDA GPU and vLLM are usable, else the CPU/GPU reference backend.
Engine flags follow vLLM's names. ``--help`` lists the flags most servers need, ``--help-all`` every flag
(the tuning ones too: kernels, graphs, warm-ups, connection timeouts); ``--config FILE`` reads flags from a
YAML or JSON file. Every flag: docs/serving.md.

Operating it (limits, auth, metrics, errors, graceful shutdown): docs/operating.md.

Exit status: 0 after a graceful shutdown (SIGTERM/SIGINT: accepted requests finish, new ones get
503); 1 when the model fails to load or the engine dies while serving; 2 for bad flags; 3 when
the server cannot listen (the port is in use, or the host cannot be bound).

Testing hooks (``CLEF_VLLM_LOAD_GATE``, ``CLEF_VLLM_FAULTS``): clef_vllm/server/faults.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys

import uvicorn

from clef_vllm.backends import BACKENDS
from clef_vllm.backends.options import OptionError, add_flags, backend_options, flag_of, given_options, on_off
from clef_vllm.schema.encoding import DEFAULT_MAX_LENGTH
from clef_vllm.schema.media import DEFAULT_MAX_MEDIA_MEMORY, DEFAULT_MEDIA_LIMITS, HOST_BYTES_PER_PIXEL, MediaLimits
from clef_vllm.schema.protocol import SYSTEMONE_DIALECTS, Dialect
from clef_vllm.server.connection import PROBE_CONNECTIONS
from clef_vllm.server.flags import Sections, add_help_flags, mark_tuning, with_config
from clef_vllm.server.settings import (BUFFERED_BODIES, DEFAULT_BODY_TIMEOUT_S, DEFAULT_CPU_INLINE_BYTES,
                                       DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                                       DEFAULT_MAX_BULK_LINES, DEFAULT_MAX_CONNECTIONS,
                                       DEFAULT_MIN_BODY_RATE, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_SERVED_MODELS,
                                       DEFAULT_SHUTDOWN_TIMEOUT_S, OVER_LENGTH_POLICIES)
from clef_vllm.version import __version__

API_KEY_ENV = "CLEF_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    """Every flag, each in its section (:mod:`clef_vllm.server.flags`): ``--help`` lists the flags most servers
    need, ``--help-all`` every one; ``--config FILE`` reads them from a file."""
    p = argparse.ArgumentParser(prog="clef-systemone", description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_help_flags(p)
    p.add_argument("--version", action="version", version=f"clef-vllm {__version__}")
    s = Sections(p)

    model = s["model"]
    model.add_argument("--model", default="demo",
                       help="checkpoint folder (release or repacked layout); 'demo' = generated tiny demo (default)")
    model.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="a name this server answers to (repeat for several): listed by /v1/models, and the model "
                            "names the hosted route POST /client/v4/accounts/{account_id}/ai/run/{NAME} accepts "
                            f"(default: {' and '.join(DEFAULT_SERVED_MODELS)})")
    model.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="auto (default): vLLM when a CUDA GPU and vLLM are usable, else reference")
    model.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                       help="the model's dtype (default bfloat16). float32 runs the reference backend in float32 "
                            "throughout, backbone and head, as the release's own loader; the vLLM backend runs "
                            "bfloat16")
    model.add_argument("--text-only", action="store_true", default=False,
                       help="serve text only: the vision tower is not loaded (its memory stays free) and a request "
                            "with images or videos gets 400")
    model.add_argument("--head-dtype", choices=["bfloat16", "float32"], default=None,
                       help="the joint head's dtype when it should differ from --dtype (e.g. a float32 head on vLLM)")

    serving = s["serving"]
    serving.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serving.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serving.add_argument("--dialect", choices=[d.value for d in SYSTEMONE_DIALECTS], default=Dialect.REFERENCE.value,
                         help="acceptance rules, confidence formula and envelope of POST /v1/systemone "
                              "(default: reference; POST /v1/decisions always speaks OpenAI's format)")
    serving.add_argument("--cpu-workers", type=_positive_int, default=None,
                         help="threads that decode, validate, encode and serialise requests off the event loop "
                              "(default: one per core, at most 8)")
    serving.add_argument("--cpu-inline-bytes", type=_non_negative_int, default=DEFAULT_CPU_INLINE_BYTES,
                         help=f"a request whose body is at most this many bytes is decoded, encoded and serialised "
                              f"on the event loop, sparing it four hops to a thread and back; 0: every request in "
                              f"the pool (default {DEFAULT_CPU_INLINE_BYTES})")
    serving.add_argument("--bulk-concurrency", type=_positive_int, default=8,
                         help="records of one bulk stream in progress at once (default 8)")
    serving.add_argument("--max-bulk-streams", type=_positive_int, default=4,
                         help="bulk streams open at once; beyond it 429 (default 4)")
    serving.add_argument("--max-bulk-lines", type=_non_negative_int, default=DEFAULT_MAX_BULK_LINES,
                         help=f"lines in one bulk body, blank ones included; the line past it is answered 413 in "
                              f"the stream, the stream ends and the rest of the body is not read; 0 = none "
                              f"(default {DEFAULT_MAX_BULK_LINES})")

    lim = s["limits"]
    lim.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_LENGTH,
                     help="token limit per request (prompt + state + schema; default 16384)")
    lim.add_argument("--over-length", choices=OVER_LENGTH_POLICIES, default="truncate",
                     help="a state that does not fit: 'truncate' cuts its end, as the reference does (reported in "
                          "usage.truncated_state_tokens); 'reject' answers 413 with the token counts. A schema that "
                          "does not fit is always 413 (default: truncate)")
    lim.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                     help=f"request body cap, 413 above it; also the per-line cap of the bulk endpoint "
                          f"(default {DEFAULT_MAX_BODY_BYTES}). Bodies held in memory at once are capped at "
                          f"{BUFFERED_BODIES} x this (429 beyond)")
    lim.add_argument("--max-in-flight", type=_positive_int, default=None,
                     help="requests in the engine at once (default: vLLM max-num-seqs x data-parallel-size; "
                          "reference: 2 x max-batch-size)")
    lim.add_argument("--max-queue", type=_non_negative_int, default=None,
                     help="requests waiting for the engine; beyond it 429 + Retry-After (default 2 x max-in-flight)")
    lim.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                     help=f"seconds from admission to answer, queueing included; then 504 and the request is "
                          f"cancelled in the engine; 0 = none (default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    lim.add_argument("--load-timeout", type=float, default=0,
                     help="seconds allowed for loading and warm-up; then exit 1; 0 = none (default)")
    lim.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                     help=f"on SIGTERM, seconds to finish accepted requests before exiting "
                          f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")

    m = DEFAULT_MEDIA_LIMITS           # images/videos of the reference dialect; workers-ai keeps the hosted limits
    lim.add_argument("--max-images", type=_non_negative_int, default=m.max_images,
                     help=f"images per request; the one past it is 422 (default {m.max_images})")
    lim.add_argument("--max-videos", type=_non_negative_int, default=m.max_videos,
                     help=f"videos per request; the one past it is 422 (default {m.max_videos})")
    lim.add_argument("--max-video-frames", type=_positive_int, default=m.max_video_frames,
                     help=f"frames of one video, 413 beyond (default {m.max_video_frames})")
    lim.add_argument("--max-image-pixels", type=_positive_int, default=m.max_pixels,
                     help=f"width x height of one image or video frame, read from its header before any pixel is "
                          f"decoded; 413 beyond (default {m.max_pixels:,}, the processor's max_pixels; the vLLM "
                          f"backend's engine profiles its vision encoder on it, and its memory plan may lower it)")
    lim.add_argument("--max-image-bytes", type=_positive_int, default=m.max_item_bytes,
                     help=f"decoded (not base64) bytes of one image or video, 413 beyond (default {m.max_item_bytes})")
    lim.add_argument("--max-media-bytes", type=_positive_int, default=m.max_total_bytes,
                     help=f"decoded bytes of all images and videos of a request, 413 beyond "
                          f"(default {m.max_total_bytes})")
    lim.add_argument("--max-media-pixels", type=_positive_int, default=m.max_total_pixels,
                     help=f"pixels of all images and video frames of a request (the decoding work), 413 beyond "
                          f"(default {m.max_total_pixels:,})")
    lim.add_argument("--max-media-memory", type=_non_negative_int, default=DEFAULT_MAX_MEDIA_MEMORY,
                     help=f"host memory (bytes) the images and videos of the requests in progress may take together, "
                          f"each pixel counted at {HOST_BYTES_PER_PIXEL} bytes (decoded and processed): a request "
                          f"whose media do not fit waits for the ones ahead of it (--request-timeout runs), one "
                          f"larger than all of it runs alone; 0 = no bound (default {DEFAULT_MAX_MEDIA_MEMORY}, 2 GiB)")

    sec = s["security"]
    sec.add_argument("--api-key", action="append", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1/* and the hosted route (repeat for several "
                          f"keys). Prefer the {API_KEY_ENV} environment variable (comma-separated keys): flags show "
                          "in ps")
    sec.add_argument("--auth-health-metrics", action="store_true",
                     help="with an API key, also require it on /health, /health/live, /metrics and the API "
                          "documentation (/docs, /redoc, /openapi.json and their assets) (default: open)")
    sec.add_argument("--cors-origins", action="append", default=None,
                     help="allow browser calls from these origins (comma-separated or repeated; '*' = any). "
                          "Default: CORS off")

    obs = s["logs"]
    obs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="default info")
    obs.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="json = one object per line with request_id; request bodies are never logged")
    obs.add_argument("--near-tie-margin", type=float, default=0.05,
                     help="an answer whose top-2 probabilities differ by less counts as a near tie in /metrics "
                          "(default 0.05)")
    obs.add_argument("--gc-freeze", type=on_off, default=True, metavar="{on,off}",
                     help="once loaded, freeze start-up's objects out of Python's full garbage collections, which "
                          "otherwise walk ~0.5 M of them on the event loop (~0.4 s) every few seconds under load "
                          "(default on; /metrics: clef_gc_pause_seconds; docs/operating.md)")

    net = s["connections"]
    net.add_argument("--header-timeout", type=_non_negative_float, default=DEFAULT_HEADER_TIMEOUT_S,
                     help=f"seconds a connection has to send a complete request head (from opening, or from the first "
                          f"byte of a later request); then it is closed (408); 0 = none "
                          f"(default {DEFAULT_HEADER_TIMEOUT_S:g})")
    net.add_argument("--body-timeout", type=_non_negative_float, default=DEFAULT_BODY_TIMEOUT_S,
                     help=f"longest pause in a request body, then 408; also in a bulk stream's input while none of "
                          f"its records is in progress, and in reading a bulk stream's output; 0 = none "
                          f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    net.add_argument("--min-body-rate", type=_non_negative_float, default=DEFAULT_MIN_BODY_RATE,
                     help=f"bytes/s a request body must average once the first --body-timeout seconds are used up "
                          f"(408 below it); 0 = none; --body-timeout 0 turns it off too "
                          f"(default {DEFAULT_MIN_BODY_RATE})")
    net.add_argument("--keep-alive-timeout", type=_non_negative_float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                     help=f"seconds an idle kept-alive connection stays open (default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})")
    net.add_argument("--max-connections", type=_positive_int, default=DEFAULT_MAX_CONNECTIONS,
                     help=f"open connections; {PROBE_CONNECTIONS} more are kept for GET /health, /health/live and "
                          f"/metrics (anything else on them gets 503), then one more gets 503 and is closed "
                          f"(default {DEFAULT_MAX_CONNECTIONS})")

    # Backend flags come from the typed options (clef_vllm.backends.options): a flag given for the
    # backend that does not run is an error (exit 2), never silently ignored.
    add_flags(lambda name: s.for_option(name, "reference"), "reference")
    add_flags(lambda name: s.for_option(name, "engine"), "vllm")
    mark_tuning(p)
    return p


def curl_example(host: str, port: int, auth: bool = False) -> str:
    """The start-up "try:" command; with ``auth`` (an API key is set) it sends ``$CLEF_API_KEY``."""
    body = {"model": "clef-flash", "state": "Checkout has been failing for every customer for the last hour.",
            "questions": {"urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
                          "team": {"type": "choice", "instructions": "Which team should handle it?",
                                   "criteria": {"billing": "Payments and refunds", "technical": "Outages and errors"}},
                          "severity": {"type": "score", "criteria": ["No impact", "Minor", "Major", "Critical"]}}}
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    key = f"-H \"Authorization: Bearer ${API_KEY_ENV}\" " if auth else ""
    return (f"curl -s http://{shown}:{port}/v1/systemone {key}-H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The reference dialect's media limits from the flags."""
    return dataclasses.replace(DEFAULT_MEDIA_LIMITS, max_images=args.max_images, max_videos=args.max_videos,
                               max_video_frames=args.max_video_frames, max_pixels=args.max_image_pixels,
                               max_item_bytes=args.max_image_bytes, max_total_bytes=args.max_media_bytes,
                               max_total_pixels=args.max_media_pixels)


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or () for v in item.split(",") if v.strip())


def _served_models(args: argparse.Namespace) -> tuple[str, ...]:
    names = tuple(name.strip() for name in args.served_model_name or ())
    if any(not name for name in names):
        build_parser().error("--served-model-name must not be empty")
    return names or DEFAULT_SERVED_MODELS


def api_keys(args: argparse.Namespace, environ=os.environ) -> tuple[str, ...]:
    """``--api-key`` values, else the comma-separated keys of ``$CLEF_API_KEY``."""
    return _split(args.api_key) or _split([environ.get(API_KEY_ENV, "")])


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None, load_with=None,
         wrap_app=None) -> int:
    """Serve until stopped; the exit status is the module docstring's. ``parser`` (a :func:`build_parser` with
    more flags), ``load_with(args, model_dir, backend, options) -> Backend`` and ``wrap_app(app, args)``: the
    same server on another backend (``clef-serve-ray``: clef_vllm/server/serve_ray.py)."""
    parser = parser or build_parser()
    args = parser.parse_args(with_config(parser, sys.argv[1:] if argv is None else list(argv)))
    from clef_vllm.util.logs import setup_logging
    from clef_vllm.util.heap import bound_native_caches

    bound_native_caches()                     # before the backend builds its first oneDNN primitive
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("clef_vllm")

    from clef_vllm.backends import make_backend, resolve_backend, vllm_usable
    from clef_vllm.backends.multinode import load_timeout
    from clef_vllm.model.demo import describe_demo, is_demo, resolve_model_dir
    from clef_vllm.server.app import create_app
    from clef_vllm.server.children import default_signals_in_forked_children, stop_children
    from clef_vllm.server.connection import ConnectionRules, protocol_class
    from clef_vllm.server.faults import wrap_load
    from clef_vllm.server.settings import ServerSettings

    if not args.body_timeout and args.min_body_rate not in (0, DEFAULT_MIN_BODY_RATE):
        parser.error("--min-body-rate: the rate applies once the first --body-timeout seconds are used up, and "
                     "--body-timeout 0 turns both off; give --body-timeout > 0 or leave --min-body-rate out")
    options = given_options(args)
    backend = resolve_backend(args.backend)
    if backend == "vllm" and args.max_image_pixels < DEFAULT_MEDIA_LIMITS.max_pixels:
        options["largest_image_pixels"] = args.max_image_pixels      # the engine profiles its vision encoder at that size
    try:
        backend_options(backend, options)
    except OptionError as exc:
        if exc.applies_to:
            chosen = f"the {backend} backend" + (f" (--backend auto: {vllm_usable()[1]})" if args.backend == "auto"
                                                 else "")
            parser.error(f"{flag_of(exc.option)} applies to the {exc.applies_to} backend only; this server would run "
                         f"{chosen}. Drop the flag or pass --backend {exc.applies_to}")
        parser.error(f"{flag_of(exc.option) if exc.option else 'options'}: {exc}")
    vllm_opts = backend_options(backend, options) if backend == "vllm" else None
    if vllm_opts is not None and vllm_opts.headless:         # engines only: clef_vllm/backends/multinode.py
        from clef_vllm.backends.multinode import run_headless

        return run_headless(resolve_model_dir(args.model), vllm_opts)
    load_failure: list[BaseException] = []
    engine_failure: list[BaseException] = []

    def load():
        model_dir = resolve_model_dir(args.model)
        if is_demo(args.model) and args.log_format != "json":    # also logged; stdout is JSON-only with json logs
            print(describe_demo(model_dir), flush=True)
        log.info("loading %s (backend %s)", model_dir, backend)
        if load_with is not None:
            return load_with(args, model_dir, backend, options)
        return make_backend(model_dir, backend, **options)

    def on_ready():
        if args.log_format == "json":     # keep the output one JSON object per line
            log.info("serving", extra={"url": f"http://{args.host}:{args.port}", "version": __version__})
            return
        key_note = ""
        if keys and (args.api_key or len(keys) > 1):
            key_note = f"  (with {API_KEY_ENV} set to one of this server's API keys)\n"
        print(f"\nclef-systemone {__version__} is serving on http://{args.host}:{args.port}  (docs: /docs)\n"
              f"try:\n  {curl_example(args.host, args.port, auth=bool(keys))}\n{key_note}", flush=True)

    def on_load_error(exc: BaseException):
        load_failure.append(exc)
        server.should_exit = True

    def on_fatal(exc: BaseException):
        engine_failure.append(exc)
        server.should_exit = True

    def on_drained():
        server.should_exit = True

    keys = api_keys(args)
    if args.auth_health_metrics and not keys:
        parser.error(f"--auth-health-metrics: no API key is set (--api-key or ${API_KEY_ENV}), so nothing would be "
                     "protected; set a key or leave the flag out")
    settings = ServerSettings(
        dialect=Dialect(args.dialect), max_body_bytes=args.max_body_bytes, served_models=_served_models(args),
        max_in_flight=args.max_in_flight, max_queue=args.max_queue,
        request_timeout_s=args.request_timeout or None, load_timeout_s=load_timeout(vllm_opts, args.load_timeout or None),
        shutdown_timeout_s=args.shutdown_timeout, over_length=args.over_length, media=media_limits(args), api_keys=keys,
        auth_health_metrics=args.auth_health_metrics, cors_origins=_split(args.cors_origins),
        near_tie_margin=args.near_tie_margin, bulk_concurrency=args.bulk_concurrency,
        max_bulk_streams=args.max_bulk_streams, max_bulk_lines=args.max_bulk_lines or None,
        max_media_memory=args.max_media_memory or None,
        header_timeout_s=args.header_timeout or None,
        body_timeout_s=args.body_timeout or None, min_body_rate=args.min_body_rate or None,
        keep_alive_timeout_s=args.keep_alive_timeout, max_connections=args.max_connections,
        cpu_workers=args.cpu_workers, cpu_inline_bytes=args.cpu_inline_bytes, freeze_heap=args.gc_freeze,
        gc_metrics=True, on_ready=on_ready, on_load_error=on_load_error, on_fatal=on_fatal, on_drained=on_drained)
    if keys:
        log.info("API key required on /v1/* and the hosted route%s (%d key(s))",
                 " and the probes" if args.auth_health_metrics else "", len(keys))
    app = create_app(wrap_load(load), settings)
    if wrap_app is not None:
        wrap_app(app, args)
    # Our own drain answers every request before uvicorn's shutdown starts; its grace period is a backstop.
    rules = ConnectionRules(header_timeout=settings.header_timeout_s, max_connections=settings.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            http=protocol_class(rules), timeout_keep_alive=settings.keep_alive_timeout_s,
                            timeout_graceful_shutdown=1)
    server = DrainingServer(config, app.state.clef)
    default_signals_in_forked_children()      # the engine processes must not inherit the drain handler
    server.run()
    stop_children()                           # e.g. an engine still starting when the server was stopped
    failure = (f"could not load the model: {load_failure[0]}" if load_failure else
               f"the engine failed while serving: {engine_failure[0]}" if engine_failure else None)
    code = 0
    if failure is not None:
        code = 1
        if args.log_format == "json":
            log.critical(failure)
        else:
            print(f"clef-systemone: {failure}", file=sys.stderr, flush=True)
    # Every request is answered and the backend is closed (or, past the shutdown timeout, every open
    # request was answered 503). Leave without the interpreter's teardown: it takes a second or more
    # with torch loaded, and it aborted (exit 134, "terminate called without an active exception")
    # in about one clean SIGTERM in three on the CPU backend, when native thread pools are destroyed
    # under threads still holding them. Logs and stdio are flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: After a second signal: how long the app's shutdown (closing the backend) may take.
FORCED_SHUTDOWN_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn with a graceful first SIGTERM/SIGINT (drain, then exit 0); a second one exits at once.

    uvicorn itself stops listening at once and re-raises the signal after shutdown (exit status
    -15); here the first signal only starts the service's drain, which sets ``should_exit``."""

    def __init__(self, config: uvicorn.Config, service):
        super().__init__(config)
        self.service = service
        self.signalled = False

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        log = logging.getLogger("clef_vllm")
        if self.signalled or self.service.loop is None:
            log.warning("%s again: exiting now", name)
            self.should_exit = self.force_exit = True
            if self.service.loop is not None:
                self.service.loop.call_soon_threadsafe(self.service.abandon_now, f"{name} again", f"a second {name}")
            return
        self.signalled = True
        log.info("%s: graceful shutdown", name)
        self.service.loop.call_soon_threadsafe(self.service.begin_drain)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown; after a forced exit uvicorn skips the app's own (lifespan) shutdown and
        the loop's teardown would cancel it mid-way (a logged traceback): run it here, bounded. Open
        requests were answered 503 by ``abandon_now``, so it only closes the backend (≤ 1 s wait)."""
        await super().shutdown(sockets)
        if self.force_exit:
            try:
                await asyncio.wait_for(self.lifespan.shutdown(), FORCED_SHUTDOWN_S)
            except asyncio.TimeoutError:
                logging.getLogger("clef_vllm").warning("application shutdown took over %g s; leaving anyway",
                                                       FORCED_SHUTDOWN_S)


if __name__ == "__main__":
    sys.exit(main())
