"""Prometheus metrics of one server (its own registry, served at ``GET /metrics``).

Counters get prometheus-client's ``_total`` suffix on the wire. ``kind`` is ``interactive``
(``POST /v1/systemone`` and the hosted route) or ``bulk`` (records of ``POST /v1/systemone/bulk``).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

from clef_vllm.server.loop_lag import INTERVAL_S, LAG_BUCKETS
from clef_vllm.version import __version__

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0)
TOKEN_BUCKETS = tuple(2 ** k for k in range(5, 19))                      # 32 .. 262,144
QUESTION_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


def top2_margin(probs: list[float]) -> float | None:
    """Largest minus second-largest probability (``None`` for a single option)."""
    if len(probs) < 2:
        return None
    first = second = float("-inf")
    for p in probs:
        if p > first:
            first, second = p, first
        elif p > second:
            second = p
    return first - second


class ServerMetrics:
    """Every instrument the server updates; see docs/operating.md for the list."""

    def __init__(self, near_tie_margin: float = 0.05):
        disable_created_metrics()  # no *_created series: this process serves only these metrics
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.near_tie_margin = near_tie_margin
        self.requests = Counter("clef_requests", "HTTP requests by route, status and reason",
                                ["route", "status", "reason"], registry=r)
        self.bulk_records = Counter("clef_bulk_records", "Bulk records finished, by status and reason",
                                    ["status", "reason"], registry=r)
        self.stage_seconds = Histogram("clef_stage_seconds", "Time per stage of a decision (see Server-Timing)",
                                       ["stage", "kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram("clef_input_tokens", "Encoded tokens per decided request",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.questions = Histogram("clef_questions_per_request", "Questions per decided request",
                                   buckets=QUESTION_BUCKETS, registry=r)
        self.batch_size = Histogram("clef_batch_size", "Requests per engine micro-batch (reference backend)",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.truncations = Counter("clef_truncations", "Requests whose state was cut to fit max_model_len",
                                   registry=r)
        self.truncated_tokens = Counter("clef_truncated_state_tokens", "State tokens cut to fit max_model_len",
                                        registry=r)
        self.prompt_tokens = Counter("clef_prompt_tokens", "Prompt tokens of answered requests: read from the state "
                                     "cache (reused) or run through the backbone (computed)", ["source"], registry=r)
        self.answers = Counter("clef_answers", "Answers returned, by question type", ["type"], registry=r)
        self.near_ties = Counter("clef_near_ties", "Answers whose top-2 probability margin is below "
                                 "clef_near_tie_margin", ["type"], registry=r)
        self.cancellations = Counter("clef_engine_cancellations", "Engine calls cancelled before they finished "
                                     "(timeout, client gone)", registry=r)
        self.engine_failures = Counter("clef_engine_failures", "Engine calls that raised", ["reason"], registry=r)
        Gauge("clef_near_tie_margin", "Threshold of the near-tie counter", registry=r).set(near_tie_margin)
        self.loop_lag = Histogram("clef_event_loop_lag_seconds", "How late an event loop ran a timer due every "
                                  f"{INTERVAL_S:g} s (http: the server's, nothing is read or sent while it is held; "
                                  "engine: the backend's engine thread's)", ["loop"], buckets=LAG_BUCKETS, registry=r)
        self.load_seconds = Gauge("clef_model_load_seconds", "Time to load and warm the model", registry=r)
        Info("clef_build", "Server version", registry=r).info({"version": __version__})

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge computed at scrape time."""
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def observe_request(self, route: str, status: int, reason: str) -> None:
        self.requests.labels(route, str(status), reason).inc()

    def observe_stages(self, kind: str, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.stage_seconds.labels(stage, kind).observe(seconds)

    def observe_decision(self, encoded, probs) -> None:
        """Input tokens, questions, truncation and near ties of one answered request."""
        self.input_tokens.observe(encoded.num_tokens)
        self.questions.observe(len(encoded.fields))
        cached = getattr(encoded, "cached_state_tokens", 0)
        self.prompt_tokens.labels("reused").inc(cached)
        self.prompt_tokens.labels("computed").inc(encoded.num_tokens - cached)
        if encoded.truncated_state_tokens:
            self.truncations.inc()
            self.truncated_tokens.inc(encoded.truncated_state_tokens)
        values = probs.tolist() if hasattr(probs, "tolist") else list(probs)
        start = 0
        for f in encoded.fields:
            n = len(f.option_ids)
            self.answers.labels(f.type).inc()
            margin = top2_margin(values[start:start + n])
            if margin is not None and margin < self.near_tie_margin:
                self.near_ties.labels(f.type).inc()
            start += n
