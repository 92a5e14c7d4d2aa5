"""``clef-serve-ray``: ``clef-systemone`` in front of N Ray Serve replicas, each running one Clef engine.

The front-end is ``clef-systemone`` itself (the same routes, limits, auth, dialects and error envelope:
:func:`clef_vllm.server.cli.main`) on a backend, :class:`ReplicaSet`, that encodes requests here and sends
each one to a replica of the :class:`ClefReplica` deployment. Replicas are chosen by Ray Serve's
consistent-hash router (``ray.serve.experimental.consistent_hash_router.ConsistentHashRouter``), keyed by
:func:`clef_vllm.schema.state_keys.state_key` through ``handle.options(session_id=...)``: every request about one
state goes to the replica whose state cache holds it. Each answer names its replica in the
``X-Clef-Replica`` response header.

A replica that dies: its requests are sent once more (the ring has moved them to a live replica, or Serve
has replaced it); a request that fails twice is answered 503 with ``Retry-After``. Serve replaces the
replica (its health check is the backend's ``check_health``). docs/deploy.md, "Many replicas".

Needs the ``ray`` extra: ``pip install './vllm_plugin[ray]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from clef_vllm.backends.base import Backend, BackendDeadError
from clef_vllm.schema.encoding import EncodedRequest, RequestEncoder
from clef_vllm.schema.errors import Kind, ServiceError
from clef_vllm.schema.state_keys import state_key

log = logging.getLogger("clef_vllm")

#: Ray Serve's router that maps a ``session_id`` onto a hash ring of the replicas
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
#: The response header that names the replica that answered
REPLICA_HEADER = "x-clef-replica"
#: ``Retry-After`` (seconds) of a request whose replica died twice
REPLICA_RETRY_AFTER_S = 2
RAY_MISSING = "clef-serve-ray needs Ray Serve: pip install './vllm_plugin[ray]' from a clef-vllm checkout"

#: The replicas that answered the current HTTP request (set by :class:`ReplicaHeader`)
_ANSWERED_BY: contextvars.ContextVar[list | None] = contextvars.ContextVar("clef_answered_by", default=None)


@dataclass
class ReplicaInfo:
    """What the front-end needs from a replica's backend: its token limit (the front-end's encoder is the
    checkpoint's tokenizer with that limit, as every backend's) and what it says about itself."""

    max_model_len: int
    max_in_flight: int
    describe: dict


class ClefReplica:
    """A Ray Serve replica: one backend (:func:`clef_vllm.backends.make_backend`) answering encoded requests."""

    def __init__(self, model_dir: str, backend: str, options: dict[str, Any]):
        from ray import serve

        from clef_vllm.backends import make_backend

        self.replica = serve.get_replica_context().replica_tag
        self.backend = make_backend(model_dir, backend, **options)
        self._started: asyncio.Future | None = None

    def info(self) -> ReplicaInfo:
        b = self.backend
        return ReplicaInfo(b.max_model_len, int(b.suggested_max_in_flight()), b.describe())

    async def decide(self, encoded: EncodedRequest) -> tuple[torch.Tensor, int, str]:
        """Per-option probabilities, cached state tokens, and this replica's tag."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.backend.start())
        await asyncio.shield(self._started)
        probs = await self.backend.decide(encoded)
        return probs.float().cpu(), encoded.cached_state_tokens, self.replica

    def check_health(self) -> None:
        """Serve's health check: raises while the engine cannot serve (Serve then replaces this replica)."""
        self.backend.check_health()

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError, BackendDeadError)


class ReplicaSet(Backend):
    """The front-end's backend: encodes here, decides on the replica its state key hashes to."""

    name = "ray-serve"

    def __init__(self, handle, info: ReplicaInfo, encoder: RequestEncoder, replicas: int,
                 app_name: str | None = None, own_cluster: bool = False):
        self.handle = handle
        self.encoder = encoder
        self.max_model_len = info.max_model_len
        self.replicas = replicas
        self.app_name = app_name
        self.own_cluster = own_cluster        # shut down on close (the local cluster this process started)
        self._replica_info = info
        self._lost = _replica_lost_errors()
        self.answers: Counter[str] = Counter()

    def routed(self, encoded: EncodedRequest):
        """The handle that routes ``encoded`` by its state: ``session_id`` = the hex state key."""
        return self.handle.options(session_id=state_key(encoded.input_ids, encoded.schema_offset, encoded.media_digest).hex())

    async def decide(self, encoded: EncodedRequest) -> torch.Tensor:
        handle = self.routed(encoded)
        for attempt in (1, 2):
            response = handle.decide.remote(encoded)
            try:
                probs, cached, replica = await response
                break
            except asyncio.CancelledError:
                response.cancel()
                raise
            except self._lost as exc:
                log.warning("replica lost (attempt %d of 2): %s", attempt, exc)
                if attempt == 2:
                    raise ServiceError("the replica holding this request stopped; retry", kind=Kind.NOT_READY,
                                       retry_after=REPLICA_RETRY_AFTER_S) from None
        encoded.cached_state_tokens = cached
        self.answers[replica] += 1
        box = _ANSWERED_BY.get()
        if box is not None:
            box.append(replica)
        return probs

    def decide_batch(self, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        responses = [self.routed(e).decide.remote(e) for e in encoded]
        return [r.result()[0] for r in responses]

    def suggested_max_in_flight(self) -> int:
        return self.replicas * self._replica_info.max_in_flight

    def describe(self) -> dict:
        return {"backend": self.name, "replicas": self.replicas, "serve_application": self.app_name, "replica_backend": self._replica_info.describe,
                "answers_by_replica": dict(self.answers)}

    def close(self) -> None:
        """Stop the local cluster this process started, replicas included. On a cluster of its own
        (``--ray-address``) the application stays for the next front-end (a rolling restart; ``serve delete``
        removes it)."""
        if self.own_cluster:
            import ray

            ray.shutdown()


class ReplicaHeader:
    """ASGI middleware: ``X-Clef-Replica`` on a response answered by one replica."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        box: list[str] = []
        token = _ANSWERED_BY.set(box)

        async def send_with_replica(message):
            if message["type"] == "http.response.start" and len(box) == 1:
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), box[0].encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            _ANSWERED_BY.reset(token)


def replica_deployment(args: argparse.Namespace, backend: str, model_dir: str, options: dict[str, Any]):
    """The :class:`ClefReplica` deployment the flags describe (replicas, resources, the consistent-hash router),
    bound to its engine's arguments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    gpus = args.replica_gpus if args.replica_gpus is not None else (1 if backend == "vllm" else 0)
    return serve.deployment(
        ClefReplica, name="ClefReplica", num_replicas=args.replicas,
        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": gpus},
        max_ongoing_requests=args.replica_max_ongoing, health_check_period_s=args.health_check_period,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER)).bind(model_dir, backend, options)


def load_replicas(args: argparse.Namespace, model_dir, backend: str, options: dict[str, Any]) -> ReplicaSet:
    """Connect to Ray (``--ray-address``, else a local cluster), deploy the replicas unless the application runs
    already, and wait until they serve."""
    import ray
    from ray import serve

    # "local": a new cluster, never one a `ray start` left on this machine (what address=None would join)
    ray.init(address=args.ray_address or "local", ignore_reinit_error=True, namespace="clef", log_to_driver=False,
             **({} if args.ray_address else {"include_dashboard": False}))
    serve.start(proxy_location="Disabled")
    running = serve.status().applications.get(args.app_name)
    if running is not None and running.status == "RUNNING":
        # another front-end (or this one, before a restart) deployed it: keep its replicas and their caches
        log.info("Serve application %r is running: serving through its replicas (serve delete %s to redeploy)",
                 args.app_name, args.app_name)
        handle = serve.get_app_handle(args.app_name)
    else:
        log.info("deploying %d replica(s) of %s (backend %s) as Serve application %r", args.replicas, model_dir,
                 backend, args.app_name)
        handle = serve.run(replica_deployment(args, backend, str(model_dir), dict(options)), name=args.app_name,
                           route_prefix=None)
    info = handle.info.remote().result()
    encoder = RequestEncoder.from_pretrained(model_dir, max_length=info.max_model_len,
                                             images="clef-serve-ray's replicas serve text only")
    return ReplicaSet(handle, info, encoder, args.replicas, app_name=args.app_name, own_cluster=not args.ray_address)


#: What a Serve config file's ``args`` may say (:func:`build_app`): ``model``, ``backend``, ``options`` (the
#: backend's options by field name, as ``make_backend`` takes them) and the replica flags by dest name
APP_ARGS = ("model", "backend", "options", "replicas", "replica_cpus", "replica_gpus", "replica_max_ongoing",
            "health_check_period")


def build_app(args: dict[str, Any]):
    """The replicas as a Serve application, for a Serve config file (``import_path:
    clef_vllm.server.serve_ray:build_app``, docs/deploy.md); ``clef-serve-ray --app-name NAME`` then serves through
    them. Unknown ``args`` and bad options are refused before anything is deployed."""
    from clef_vllm.backends import backend_options, resolve_backend
    from clef_vllm.model.demo import resolve_model_dir

    unknown = sorted(set(args) - set(APP_ARGS))
    if unknown:
        raise ValueError(f"unknown clef_vllm.server.serve_ray:build_app args {unknown}; it takes {list(APP_ARGS)}")
    ns = build_parser().parse_args([])
    for name in APP_ARGS[3:]:
        if name in args:
            setattr(ns, name, args[name])
    backend = resolve_backend(args.get("backend", "auto"))
    options = dict(args.get("options") or {})
    backend_options(backend, options)                  # OptionError naming a bad one
    return replica_deployment(ns, backend, str(resolve_model_dir(args.get("model", "demo"))), options)


def build_parser() -> argparse.ArgumentParser:
    """``clef-systemone``'s flags plus the replica set's."""
    from clef_vllm.server import cli

    p = cli.build_parser()
    p.prog = "clef-serve-ray"
    p.description = __doc__
    g = p.add_argument_group("Ray Serve replicas")
    g.add_argument("--replicas", type=cli._positive_int, default=2, help="replicas, one engine each (default 2)")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on: its GCS address (HEAD_IP:6379) or 'auto' (the cluster this node joined); default: start a local one")
    g.add_argument("--app-name", default="clef", help="the Serve application's name (default clef)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs Ray reserves per replica (default: 1 for --backend vllm, else 0)")
    g.add_argument("--replica-max-ongoing", type=cli._positive_int, default=256,
                   help="requests a replica takes at once before the router tries the next replica on the ring "
                        "(default 256)")
    g.add_argument("--health-check-period", type=float, default=5.0,
                   help="seconds between Serve's health checks of each replica (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        import ray.serve  # noqa: F401 - fail early, naming the extra
    except ImportError:
        print(f"clef-serve-ray: {RAY_MISSING}", file=sys.stderr)
        return 2
    from clef_vllm.server import cli

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return cli.main(argv, parser=build_parser(), load_with=load_replicas,
                    wrap_app=lambda app, args: app.add_middleware(ReplicaHeader))


if __name__ == "__main__":
    sys.exit(main())
