"""``clef-serve-ray`` (clef_vllm/server/serve_ray.py): two reference-backend replicas on the tiny checkpoint behind
the front-end, on a Ray cluster on loopback started once for the module. Answers equal a single server's,
a state's requests meet one replica, and a replica killed under load costs no wrong answer."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install './vllm_plugin[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install './vllm_plugin[ray]')")

from clef_vllm.model.features import HeadSpec  # noqa: E402
from clef_vllm.schema.encoding import RequestEncoder  # noqa: E402
from clef_vllm.schema.protocol import SystemOneRequest  # noqa: E402
from clef_vllm.schema.state_keys import KEY_UNIT, state_key  # noqa: E402
from clef_vllm.server.serve_ray import REPLICA_HEADER  # noqa: E402
from clef_vllm.testing.server import LiveServer  # noqa: E402
from conftest import REQUEST  # noqa: E402

#: replica actors of the app under test (Serve names them SERVE_REPLICA::APP#DEPLOYMENT#TAG)
REPLICA_PREFIX = "SERVE_REPLICA::clef-test#ClefReplica#"


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict, str]:
    """``(status, headers, text)`` of a JSON POST (status 0: no HTTP answer)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()
    except OSError as e:
        return 0, {}, f"{type(e).__name__}: {e}"


def ticket(i: int) -> dict:
    """A request about state ``i`` (distinct states, the same questions)."""
    return {**REQUEST, "state": f"Ticket {i}: checkout has been failing for customer {i * 7919} since {i}:00."}


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster on loopback for the module (this process its driver; its SIGTERM handler given back)."""
    handler = signal.getsignal(signal.SIGTERM)
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="clef-test-driver", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, handler)


@pytest.fixture(scope="module")
def replicas(cluster, tiny_release):
    server = LiveServer([], ready_timeout=120.0, command=lambda port: [
        sys.executable, "-m", "clef_vllm.server.serve_ray", "--port", str(port), "--model", str(tiny_release),
        "--backend", "reference", "--replicas", "2", "--ray-address", cluster, "--app-name", "clef-test",
        "--health-check-period", "2"]).wait_ready()
    yield server
    server.stop()


def replica_actors() -> list[str]:
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names if a["name"].startswith(REPLICA_PREFIX))


def test_the_route_key_is_the_state_caches_key(tiny_release):
    """The front-end routes by the key the vLLM backend's engine affinity uses (its state cache's keys)."""
    enc = RequestEncoder.from_pretrained(tiny_release).encode(SystemOneRequest.model_validate(ticket(3)))
    spec = HeadSpec.from_encoded(enc, state_keys=True)
    assert state_key(enc.input_ids, enc.schema_offset) == spec.state_keys[enc.schema_offset // KEY_UNIT - 1]


def test_answers_equal_a_single_servers(replicas, live_server):
    bodies = [ticket(i) for i in range(4)] + [{**REQUEST, "questions": {"x": {"type": "noul", "instructions": ""}}},
                                              {**REQUEST, "questions": {}}, {"state": "no model"}]
    for body in bodies:
        status, headers, text = post(replicas.url + "/v1/systemone", body)
        want_status, _, want = post(live_server.url + "/v1/systemone", body)
        assert (status, json.loads(text)) == (want_status, json.loads(want)), body
        assert (REPLICA_HEADER in headers) == (status == 200)
    decisions = {"model": "clef-flash", "input": "Checkout is down for every customer.",
                 "questions": [{"type": "predicate", "name": "urgent", "instructions": "Does this need action today?"}]}
    got, want = post(replicas.url + "/v1/decisions", decisions), post(live_server.url + "/v1/decisions", decisions)
    assert got[0] == want[0] == 200
    strip = lambda text: {k: v for k, v in json.loads(text).items() if k not in ("id", "created_at")}  # noqa: E731
    assert strip(got[2]) == strip(want[2])


def test_each_state_returns_to_one_replica(replicas):
    seen: dict[int, set[str]] = {i: set() for i in range(12)}
    lock = threading.Lock()

    def send(i: int) -> None:
        status, headers, _ = post(replicas.url + "/v1/systemone", ticket(100 + i))
        assert status == 200
        with lock:
            seen[i].add(headers[REPLICA_HEADER])

    # 3 requests a state: one replica all 3 times by chance is 1 in 4 a state, 1 in 16 million for all 12
    threads = [threading.Thread(target=send, args=(i,)) for i in range(12) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(tags) == 1 for tags in seen.values()), seen
    assert len(set().union(*seen.values())) == 2            # and the states spread over both replicas


def test_a_replica_killed_under_load_costs_no_wrong_answer_and_is_replaced(replicas, live_server):
    expected = {i: json.loads(post(live_server.url + "/v1/systemone", ticket(200 + i))[2]) for i in range(8)}
    before = replica_actors()
    assert len(before) == 2
    outcomes: list[tuple[int, dict, str, int]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        k = worker
        while not stop.is_set():
            i = k % 8
            status, headers, text = post(replicas.url + "/v1/systemone", ticket(200 + i))
            outcomes.append((status, headers, text, i))
            k += 3

    workers = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for w in workers:
        w.start()
    while len(outcomes) < 6:
        time.sleep(0.05)
    kill_at = len(outcomes)
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    time.sleep(3)
    stop.set()
    for w in workers:
        w.join()
    killed = before[0].rsplit("#", 1)[1]
    home = {i: headers[REPLICA_HEADER] for status, headers, _, i in outcomes[:kill_at] if status == 200}
    for status, headers, text, i in outcomes:
        if status == 200:
            assert json.loads(text) == expected[i]
        else:                                   # the killed replica's requests, twice unlucky: a clean 503
            assert status == 503 and "retry-after" in headers, (status, text)
            assert home.get(i) in (killed, None), f"state {i} lived on the surviving replica and got {status}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = replica_actors()
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(0.5)
    assert len(now) == 2 and before[0] not in now, now
    new_tag = (set(now) - set(before)).pop().rsplit("#", 1)[1]
    tags, k = set(), 0
    while new_tag not in tags and time.monotonic() < deadline:     # the replacement serves its states
        status, headers, text = post(replicas.url + "/v1/systemone", ticket(300 + k))
        if status == 200:
            tags.add(headers[REPLICA_HEADER])
        k += 1
    assert new_tag in tags


def test_another_front_end_serves_through_the_running_replicas(cluster, tiny_release, replicas, live_server):
    """A front-end started while the application runs (a rolling restart, a second ingress) keeps its replicas."""
    before = replica_actors()
    other = LiveServer([], ready_timeout=120.0, command=lambda port: [
        sys.executable, "-m", "clef_vllm.server.serve_ray", "--port", str(port), "--model", str(tiny_release),
        "--backend", "reference", "--replicas", "2", "--ray-address", cluster, "--app-name", "clef-test"]).wait_ready()
    try:
        status, headers, text = post(other.url + "/v1/systemone", ticket(400))
        assert status == 200 and json.loads(text) == json.loads(post(live_server.url + "/v1/systemone", ticket(400))[2])
        assert replica_actors() == before and REPLICA_PREFIX + headers[REPLICA_HEADER] in before
    finally:
        other.stop()
    assert replica_actors() == before


def test_a_serve_config_file_builds_the_same_replicas(tiny_release):
    """``import_path: clef_vllm.server.serve_ray:build_app`` deploys what ``clef-serve-ray`` deploys."""
    from clef_vllm.backends.options import OptionError
    from clef_vllm.server.serve_ray import ROUTER, build_app

    app = build_app({"model": str(tiny_release), "backend": "reference", "replicas": 3, "replica_cpus": 2,
                     "options": {"max_batch_size": 4}})
    deployment = app._bound_deployment
    assert (deployment.name, deployment.num_replicas) == ("ClefReplica", 3)
    assert deployment._deployment_config.request_router_config.request_router_class == ROUTER
    assert deployment.ray_actor_options == {"num_cpus": 2, "num_gpus": 0}
    assert deployment.init_args == (str(tiny_release), "reference", {"max_batch_size": 4})
    with pytest.raises(ValueError, match="unknown"):
        build_app({"model": str(tiny_release), "replica": 3})
    # docs/deploy.md's config file is a valid Serve config whose args build_app takes
    import re

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from conftest import REPO

    text = re.search(r"^```yaml\n(.*?)^```", (REPO / "docs" / "deploy.md").read_text(), re.M | re.S).group(1)
    config = ServeDeploySchema.model_validate(yaml.safe_load(text)).applications[0]
    module, _, name = config.import_path.partition(":")
    assert module == build_app.__module__ and name == "build_app" and config.route_prefix is None
    assert build_app({**config.args, "model": str(tiny_release)})._bound_deployment.num_replicas == config.args["replicas"]
    with pytest.raises(OptionError):
        build_app({"model": str(tiny_release), "backend": "reference", "options": {"max_num_seqs": 8}})
