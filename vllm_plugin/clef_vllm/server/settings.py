"""Server settings in one place (the CLI fills them from flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from clef_vllm.schema.media import DEFAULT_MAX_MEDIA_MEMORY, DEFAULT_MEDIA_LIMITS, MediaLimits
from clef_vllm.schema.protocol import Dialect

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Names the server answers to by default: ours, and the hosted model's (the hosted route's path).
DEFAULT_SERVED_MODELS = ("clef-flash", "@cf/cloudflare/clef-flash")
DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MIN_BODY_RATE = 16384
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 2048
#: Lines of one bulk body (blank ones included); the line past it is answered 413 and the rest is not read.
DEFAULT_MAX_BULK_LINES = 100_000
#: A request whose body is at most this many bytes has its CPU work done on the event loop, not in the pool:
#: each of a request's four hops to a pool thread and back costs 50-205 µs of CPU (bench/results/cpu_pool_hop.txt, 2 cores),
#: about as much as a short decision's own work, and the loop is held for about a millisecond at most.
DEFAULT_CPU_INLINE_BYTES = 4096
#: Request bodies held in memory at once, in multiples of --max-body-bytes (beyond: 429).
BUFFERED_BODIES = 16
OVER_LENGTH_POLICIES = ("truncate", "reject")


@dataclass
class ServerSettings:
    """Everything the app needs besides the backend. ``None`` limits are sized from the backend."""

    dialect: Dialect = Dialect.REFERENCE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_models: tuple[str, ...] = DEFAULT_SERVED_MODELS   # /v1/models; model names of the hosted route
    # admission control
    max_in_flight: int | None = None          # default: backend.suggested_max_in_flight()
    max_queue: int | None = None              # default: 2 x max_in_flight
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    load_timeout_s: float | None = None
    health_poll_s: float = 1.0
    # size limits
    over_length: str = "truncate"             # "truncate" (cut the state's end) | "reject" (413)
    media: MediaLimits = DEFAULT_MEDIA_LIMITS  # images/videos of the reference dialect (workers-ai: the hosted limits)
    max_buffered_bytes: int | None = None     # default: BUFFERED_BODIES x max_body_bytes
    max_media_memory: int | None = DEFAULT_MAX_MEDIA_MEMORY   # media of requests in progress (bytes); None: no bound
    # slow clients and connections
    header_timeout_s: float | None = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    min_body_rate: float | None = DEFAULT_MIN_BODY_RATE
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    # CPU pool (decode, validate, encode, serialise)
    cpu_workers: int | None = None            # default: one per core, at most 8
    cpu_inline_bytes: int = DEFAULT_CPU_INLINE_BYTES   # bodies up to this size: their work on the loop (0: none)
    # auth and browsers
    api_keys: tuple[str, ...] = ()
    auth_health_metrics: bool = False
    cors_origins: tuple[str, ...] = ()
    # metrics
    near_tie_margin: float = 0.05
    # bulk endpoint
    bulk_concurrency: int = 8
    max_bulk_streams: int = 4
    max_bulk_lines: int | None = DEFAULT_MAX_BULK_LINES
    # process: once loaded, move what start-up allocated out of the garbage collector's full collections
    # (``clef_vllm.util.heap.freeze_heap``; ``--gc-freeze``), and time the full collections for /metrics
    # (``clef_gc_pause_seconds``: a process-wide hook). The CLI's own process does both; in-process users need not.
    freeze_heap: bool = False
    gc_metrics: bool = False
    # hooks (the CLI uses them to print the banner and to set the exit status)
    on_ready: Callable[[], None] | None = None
    on_load_error: Callable[[BaseException], None] | None = None
    on_fatal: Callable[[BaseException], None] | None = None
    on_drained: Callable[[], None] | None = None

    def __post_init__(self):
        if self.over_length not in OVER_LENGTH_POLICIES:
            raise ValueError(f"over_length must be one of {OVER_LENGTH_POLICIES}, got {self.over_length!r}")
        self.dialect = Dialect(self.dialect)
        if self.max_buffered_bytes is None:
            self.max_buffered_bytes = BUFFERED_BODIES * self.max_body_bytes
        self.served_models = tuple(dict.fromkeys(self.served_models))
        if not self.served_models or not all(isinstance(n, str) and n.strip() for n in self.served_models):
            raise ValueError(f"served_models must be non-empty names, got {self.served_models!r}")
