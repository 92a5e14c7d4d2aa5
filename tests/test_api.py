"""The offline API: ``from clef_vllm import Clef``."""

from __future__ import annotations

import json

import pytest
import torch

import clef_vllm
from clef_vllm.schema.errors import Kind
from clef_vllm.schema.media import HOST_BYTES_PER_PIXEL
from clef_vllm.schema.protocol import RequestError

REQUEST = {
    "model": "clef-flash",
    "state": {"invoice": {"vendor": "Acme", "total": 1250.0, "currency": "USD", "status": "overdue"}},
    "questions": {
        "status": {"type": "choice", "instructions": "What is the invoice status?",
                   "criteria": {"paid": "Invoice is paid.", "overdue": "Invoice is past due.", "draft": "Not sent."}},
        "large": {"type": "noul", "instructions": "Is the total above 1000 USD?"},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Can wait", "This week", "Today"]},
    },
}


def variant(state, **questions):
    return {"model": "clef-flash", "state": state, "questions": questions or REQUEST["questions"]}


@pytest.fixture(scope="module")
def clef(tiny_release, cache_dir):
    from clef_vllm import Clef

    with Clef(tiny_release, backend="reference") as c:
        yield c


def check_shapes(body: dict, request: dict) -> None:
    assert list(body) == ["model", "answers", "usage"]
    assert body["model"] == request["model"]
    assert list(body["answers"]) == list(request["questions"])
    for qid, ans in body["answers"].items():
        q = request["questions"][qid]
        assert ans["type"] == q["type"]
        if q["type"] == "noul":
            assert list(ans) == ["type", "noul"] and 0 <= ans["noul"] <= 1
        elif q["type"] == "choice":
            assert list(ans) == ["type", "choice", "confidence", "probabilities"]
            assert list(ans["probabilities"]) == list(q["criteria"])
            assert ans["choice"] in q["criteria"]
            assert ans["confidence"] == max(ans["probabilities"].values())
            assert abs(sum(ans["probabilities"].values()) - 1) < 5e-4
        else:
            assert list(ans) == ["type", "score", "confidence", "legend", "probabilities"]
            n = len(q["criteria"])
            assert ans["legend"] == {str(i): c for i, c in enumerate(q["criteria"])}
            assert list(ans["probabilities"]) == [str(i) for i in range(n)]
            assert 0 <= ans["score"] <= n - 1
            assert abs(ans["score"] - sum(i * p for i, p in enumerate(ans["probabilities"].values()))) < 1e-3
    usage = body["usage"]
    assert usage["output_tokens"] == 0 and usage["input_tokens"] > 36
    for value in json.loads(json.dumps(body))["answers"].values():   # plain JSON types, 4 decimals at most
        for key in ("noul", "score", "confidence"):
            if key in value:
                assert value[key] == round(value[key], 4)


def test_import_is_lazy_and_exposes_clef():
    assert "Clef" in clef_vllm.__all__
    from clef_vllm import Clef
    from clef_vllm.api import Clef as ApiClef

    assert Clef is ApiClef
    with pytest.raises(AttributeError):
        clef_vllm.NotAThing  # noqa: B018


def test_systemone_answers_all_three_question_types(clef):
    body = clef.systemone(REQUEST)
    check_shapes(body, REQUEST)
    enc = clef.backend.encoder.encode(clef_vllm.schema.dialects.parse_request(REQUEST))
    assert body["usage"]["input_tokens"] == enc.num_tokens
    assert body["usage"]["truncated_state_tokens"] == 0
    assert clef.systemone(REQUEST) == body                 # deterministic


def test_systemone_batch_preserves_order(clef):
    requests = [variant(f"ticket {i}: " + "checkout fails " * i) for i in range(5)]
    requests.insert(2, variant("short", only={"type": "noul", "instructions": "Is it short?"}))
    batch = clef.systemone_batch(requests)
    assert len(batch) == len(requests)
    for req, body in zip(requests, batch):
        check_shapes(body, req)
        alone = clef.systemone(req)
        assert body["usage"] == alone["usage"]
        for qid, ans in body["answers"].items():
            for key in ("noul", "score", "confidence"):
                if key in ans:
                    assert abs(ans[key] - alone["answers"][qid][key]) <= 1e-2 * (2 if key == "score" else 1)
    lengths = [b["usage"]["input_tokens"] for b in batch]
    assert lengths[2] < lengths[1] and lengths[3] < lengths[4] < lengths[5]   # order follows the input
    assert clef.systemone_batch([]) == []


def test_invalid_item_raises_naming_its_index_before_any_work(clef, monkeypatch):
    calls = []
    monkeypatch.setattr(clef.backend, "decide_batch", lambda enc: calls.append(enc) or [])
    bad = variant("x", team={"type": "choice", "instructions": "Which?", "criteria": ["a", "b"]})
    with pytest.raises(RequestError) as info:
        clef.systemone_batch([REQUEST, REQUEST, bad, REQUEST])
    assert info.value.field == "requests[2].questions.team.criteria"
    assert str(info.value) == "requests[2].questions.team.criteria: must be an object"
    assert isinstance(info.value, ValueError) and info.value.kind is Kind.INVALID
    with pytest.raises(RequestError, match=r"^requests\[1\]: request body must be a JSON object$"):
        clef.systemone_batch([REQUEST, ["not", "a", "dict"]])
    with pytest.raises(RequestError, match=r"^questions.team.criteria: must be an object$"):
        clef.systemone(bad)                                    # a single request: no index
    with pytest.raises(RequestError, match="videos: videos are not served") as info:
        png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
        clef.systemone(REQUEST | {"videos": [[png, png]]})     # a valid video of two frames: validated, then refused
    assert info.value.kind is Kind.UNSUPPORTED
    assert calls == []


def test_a_batch_with_more_media_than_max_media_memory_is_decided_in_chunks(clef, monkeypatch):
    """Consecutive chunks whose media fit ``max_media_memory`` (a text request costs nothing; a request over it runs
    alone), the answers in order and equal to the batch decided at once."""
    from clef_vllm.api import media_chunks
    from clef_vllm.testing.images import data_uri, picture

    assert [list(c) for c in media_chunks([5, 0, 5, 5, 20, 0, 1], 10)] == [[0, 1, 2], [3], [4], [5, 6]]
    assert [list(c) for c in media_chunks([5, 5, 5], None)] == [[0, 1, 2]] and media_chunks([], 10) == []
    pictures = [data_uri(picture((64, 64), seed)) for seed in range(5)]
    batch = [REQUEST | {"images": [pictures[0]]}, REQUEST, REQUEST | {"images": [pictures[1]]},
             REQUEST | {"images": pictures[2:4]}, REQUEST | {"images": [pictures[4]]}]
    whole = clef.systemone_batch(batch)
    chunks = []
    decide = clef.backend.decide_batch
    monkeypatch.setattr(clef.backend, "decide_batch", lambda enc: chunks.append(len(enc)) or decide(enc))
    monkeypatch.setattr(clef, "max_media_memory", 2 * 64 * 64 * HOST_BYTES_PER_PIXEL)   # two 64 x 64 pictures
    assert clef.systemone_batch(batch) == whole
    assert chunks == [3, 1, 1]


def test_reference_dialect_ignores_unknown_fields_and_says_so(clef):
    request = REQUEST | {"id": "rec-7", "media_kwargs": {"x": 1}, "unknown": True}
    request["questions"] = {**REQUEST["questions"], "large": {**REQUEST["questions"]["large"], "instuctions": "typo"}}
    body = clef.systemone(request)
    assert body.pop("warnings") == ["id: unknown field, ignored", "media_kwargs: unknown field, ignored",
                                    "unknown: unknown field, ignored", "questions.large.instuctions: unknown field, ignored"]
    check_shapes(body, REQUEST)
    assert "warnings" not in clef.systemone(REQUEST)


def test_truncation_is_reported_in_usage(tiny_release, cache_dir):
    from clef_vllm import Clef

    with Clef(tiny_release, backend="reference", max_model_len=600) as small:
        assert small.backend.max_model_len == 600
        body = small.systemone(variant("word " * 2000))
        assert body["usage"]["input_tokens"] == 600
        assert body["usage"]["truncated_state_tokens"] > 1000
        huge = variant("x", **{f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(30)})
        with pytest.raises(RequestError, match=r"schema requires \d+ tokens before state; maximum is 600") as info:
            small.systemone(huge)
        assert info.value.kind is Kind.SCHEMA_TOO_LONG


def test_dtype_float32_and_workers_ai_dialect(tiny_release, clef, cache_dir):
    from clef_vllm import Clef

    with Clef(tiny_release, backend="reference", dtype="float32", dialect="workers-ai") as hosted:
        assert hosted.backend.head.dtype == torch.float32
        body = hosted.systemone(REQUEST)
        check_confidence = body["answers"]["status"]
        probs = list(check_confidence["probabilities"].values())
        n = len(probs)
        gini = min(1.0, max(0.0, (n * sum(p * p for p in probs) - 1) / (n - 1)))
        assert check_confidence["confidence"] == round(gini, 4)
        ref = clef.systemone(REQUEST)
        for qid in REQUEST["questions"]:
            a, b = body["answers"][qid], ref["answers"][qid]
            for key in ("noul", "score"):
                if key in a:
                    assert abs(a[key] - b[key]) < 5e-2
        with pytest.raises(RequestError, match="unknown field"):
            hosted.systemone(REQUEST | {"id": "x"})
        with pytest.raises(RequestError, match="instructions are required"):
            hosted.systemone(variant("x", q={"type": "noul"}))


def test_context_manager_closes_the_backend(tiny_release, cache_dir):
    from clef_vllm import Clef

    closed = []
    with Clef(tiny_release, backend="reference") as c:
        original = c.backend.close
        c.backend.close = lambda: (closed.append(True), original())
        c.systemone(REQUEST)
    assert closed == [True]


def test_bad_arguments_are_refused(tiny_release, tmp_path):
    from clef_vllm import Clef

    with pytest.raises(ValueError, match="backend must be one of"):
        Clef(tiny_release, backend="onnx")
    with pytest.raises(ValueError):
        Clef(tiny_release, backend="reference", dialect="hosted")
    with pytest.raises(ValueError, match="'dtype' must be one of"):
        Clef(tiny_release, backend="reference", dtype="int4")
    with pytest.raises(ValueError, match="'gpu_memory_utilization' applies to the vllm backend"):
        Clef(tiny_release, backend="reference", gpu_memory_utilization=0.5)    # never silently dropped
    from clef_vllm.model.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="not a directory"):
        Clef(tmp_path / "missing", backend="reference")


def test_vllm_backend_without_vllm_names_the_extra_to_install(tiny_release, monkeypatch):
    import sys

    from clef_vllm import Clef

    monkeypatch.setitem(sys.modules, "vllm", None)          # as if vLLM were not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install './vllm_plugin\[vllm\]'"):
        Clef(tiny_release, backend="vllm")


@pytest.mark.parametrize("body, kind, field, message", [
    ({"model": "m", "state": "s", "questions": {1: {"type": "noul"}}}, Kind.INVALID, "questions",
     "keys must be strings"),
    (variant({"n": float("nan")}), Kind.MALFORMED, "state", "nan is not valid JSON"),
    (variant([1.0, {"deep": [float("-inf")]}]), Kind.MALFORMED, "state", "-inf is not valid JSON"),
    (variant({2: "two", "b": 1}), Kind.INVALID, "state", "keys must be strings"),
])
def test_python_values_that_json_cannot_carry_raise_the_http_paths_typed_errors(clef, body, kind, field, message):
    """Python values JSON cannot carry raise the HTTP path's typed errors, never a raw TypeError: a key that is
    not a string is INVALID (422 over HTTP), NaN or Infinity is MALFORMED (400 over HTTP)."""
    with pytest.raises(RequestError) as err:
        clef.systemone(body)
    assert err.value.kind is kind and err.value.field == field and message in str(err.value)
