"""Answerers for ``clef-parity``: an HTTP endpoint or an offline backend, behind one interface.

A target spec is either an ``http(s)://`` URL (base or full ``/v1/systemone``) or
``BACKEND:DIR`` with BACKEND one of ``reference``, ``vllm``, ``auto`` (the offline
:class:`clef_vllm.Clef` API). Every target answers a list of bodies under one *condition*: a
concurrency (HTTP: that many requests in flight; offline: batches of that size) and an order
(which requests are in flight together). Answers come back in request order.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from clef_vllm.bench.loadgen import base_url, closed_loop, systemone_url, unwrap_envelope

OFFLINE_BACKENDS = ("reference", "vllm", "auto")


@dataclass
class Answered:
    """One request's result: ``status`` 200 with ``body``, or an HTTP status / error kind with ``error``."""

    status: str
    body: dict | None = None
    error: str | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "200" and isinstance(self.body, dict)


@dataclass(frozen=True)
class Condition:
    """How a pass is run: ``concurrency`` in flight / per batch, requests in ``order``."""

    name: str
    concurrency: int
    order: str = "request"   # "request" or "shuffled"
    seed: int = 0

    def indices(self, n: int) -> list[int]:
        import random

        idx = list(range(n))
        if self.order == "shuffled":
            random.Random(self.seed).shuffle(idx)
        return idx

    def describe(self) -> dict:
        return {"name": self.name, "concurrency": self.concurrency, "order": self.order,
                **({"seed": self.seed} if self.order == "shuffled" else {})}


class Target(ABC):
    """Something that answers SystemOne bodies."""

    spec: str

    @abstractmethod
    def answer(self, bodies: Sequence[dict], condition: Condition,
               progress: Callable[[], None] | None = None) -> list[Answered]:
        """Answers for ``bodies`` (in request order) under ``condition``."""

    def describe(self) -> dict:
        return {"spec": self.spec}

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release engines and connections."""


class HttpTarget(Target):
    """A ``/v1/systemone`` endpoint."""

    def __init__(self, url: str, *, timeout: float = 600.0, headers: dict | None = None):
        self.spec = url
        self.url = systemone_url(url)
        self.timeout = timeout
        self.headers = headers or {}

    def describe(self) -> dict:
        info: dict[str, Any] = {"spec": self.spec, "kind": "http", "url": self.url}
        try:
            import httpx

            r = httpx.get(base_url(self.url) + "/v1/models", timeout=10.0, headers=self.headers)
            if r.status_code == 200:
                info["models"] = r.json()
        except Exception:  # noqa: BLE001 - informational only
            pass
        return info

    def answer(self, bodies, condition, progress=None):
        return asyncio.run(self._answer(bodies, condition, progress))

    async def _answer(self, bodies, condition, progress):
        import httpx

        c = condition.concurrency
        limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 30.0)),
                                     limits=limits, headers=self.headers) as client:
            async def post(i: int) -> Answered:
                payload = json.dumps(bodies[i], ensure_ascii=False).encode()
                t0 = time.perf_counter()
                try:
                    r = await client.post(self.url, content=payload, headers={"content-type": "application/json"})
                except httpx.TimeoutException:
                    return Answered("timeout", error="timed out", latency_s=time.perf_counter() - t0)
                except httpx.HTTPError as exc:
                    return Answered(type(exc).__name__, error=str(exc)[:300], latency_s=time.perf_counter() - t0)
                latency = time.perf_counter() - t0
                if r.status_code != 200:
                    return Answered(str(r.status_code), error=r.text[:300], latency_s=latency)
                try:
                    return Answered("200", body=unwrap_envelope(r.json()), latency_s=latency)
                except ValueError as exc:
                    return Answered("bad_response", error=str(exc)[:300], latency_s=latency)

            order = condition.indices(len(bodies))
            results, _ = await closed_loop(order, c, post, on_done=progress)
        out: list[Answered | None] = [None] * len(bodies)
        for i, res in zip(order, results):
            out[i] = res
        return out


class OfflineTarget(Target):
    """The in-process :class:`clef_vllm.Clef` API on a checkpoint folder."""

    def __init__(self, backend: str, model_dir: str, **options: Any):
        from clef_vllm.api import Clef

        self.spec = f"{backend}:{model_dir}"
        self.backend = backend
        self.options = options
        self.clef = Clef(model_dir, backend=backend, **options)

    def describe(self) -> dict:
        info = {"spec": self.spec, "kind": "offline", "backend": self.backend,
                "options": {k: v for k, v in self.options.items() if v is not None}}
        try:
            info["describe"] = self.clef.backend.describe()
        except Exception:  # noqa: BLE001 - informational only
            pass
        return info

    def _one(self, body: dict) -> Answered:
        from clef_vllm.schema.errors import ClefError
        from clef_vllm.server.errors import outcome

        t0 = time.perf_counter()
        try:
            return Answered("200", body=self.clef.systemone(body), latency_s=time.perf_counter() - t0)
        except ClefError as exc:                  # the status the server would answer
            return Answered(str(outcome(exc).status), error=str(exc)[:300], latency_s=time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - reported per request
            return Answered("exception", error=f"{type(exc).__name__}: {exc}"[:300], latency_s=time.perf_counter() - t0)

    def answer(self, bodies, condition, progress=None):
        out: list[Answered | None] = [None] * len(bodies)
        order = condition.indices(len(bodies))
        size = max(1, condition.concurrency)
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            t0 = time.perf_counter()
            try:
                answers = self.clef.systemone_batch([bodies[i] for i in chunk])
                latency = time.perf_counter() - t0
                for i, a in zip(chunk, answers):
                    out[i] = Answered("200", body=a, latency_s=latency)
            except Exception:  # noqa: BLE001 - an invalid request fails its batch: isolate it
                for i in chunk:
                    out[i] = self._one(bodies[i])
            if progress is not None:
                for _ in chunk:
                    progress()
        return out

    def close(self) -> None:
        self.clef.close()


def open_target(spec: str, *, timeout: float = 600.0, headers: dict | None = None, **offline_options: Any) -> Target:
    """Parse a target spec (``http(s)://…`` or ``reference:DIR`` / ``vllm:DIR`` / ``auto:DIR``)."""
    if spec.startswith(("http://", "https://")):
        return HttpTarget(spec, timeout=timeout, headers=headers)
    backend, sep, path = spec.partition(":")
    if not sep or backend not in OFFLINE_BACKENDS or not path:
        raise ValueError(f"target must be an http(s) URL or BACKEND:DIR with BACKEND in {OFFLINE_BACKENDS}, "
                         f"got {spec!r}")
    return OfflineTarget(backend, path, **{k: v for k, v in offline_options.items() if v is not None})
