"""OpenAI's Decisions API (``POST /v1/decisions``) on a real uvicorn server (reference backend, CPU),
called with the official ``openai`` SDK (sync and async) and LangChain's ``OpenAIDecisions``, both
unmodified, and through the offline API (``Clef.decisions``).

Every answer is checked against the same decision asked through ``POST /v1/systemone`` with the
SystemOne body written out here by hand (not by the mapping under test): the probabilities are
the very same numbers. Errors must reach the SDKs as their typed exceptions; hostile bodies get
OpenAI's error envelope, never a 500.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.openai_decisions import parse_decision_request
from conftest import LiveServer

KEY = "decisions-test-key-0123456789"
MAX_LEN = 1024
STATE = "Checkout has been failing for every customer for the last hour."
PNG_1X1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

#: One question of each type; the choice has a boolean value and the score an unnamed question.
QUESTIONS = [
    {"type": "predicate", "name": "urgent", "instructions": "Is this support request urgent?"},
    {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
     "choices": [{"value": "technical", "description": "Outages, errors, and configuration"},
                 {"value": "billing", "description": "Payments, invoices, and refunds"}, {"value": False}]},
    {"type": "score", "instructions": "How severe?",
     "levels": [{"label": "No impact"}, {"label": "Minor"}, {"label": "Major", "description": "Many users"},
                {"label": "Critical"}]},
]
#: The same decision as a SystemOne request (the mapping docs/operating.md documents).
SYSTEMONE = {
    "model": "clef-flash", "state": STATE,
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"technical": "Outages, errors, and configuration",
                              "billing": "Payments, invoices, and refunds", "false": None}},
        "question_2": {"type": "score", "instructions": "How severe?",
                       "criteria": ["No impact", "Minor", "Major: Many users", "Critical"]},
    },
}

#: SystemOne option id -> the typed Decisions value.
VALUES = {"technical": "technical", "billing": "billing", "false": False}


def gini(probs: list[float]) -> float:
    n = len(probs)
    return round(min(1.0, max(0.0, (n * sum(p * p for p in probs) - 1) / (n - 1))), 4)


@pytest.fixture(scope="module")
def server(tiny_release, cache_dir):
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--api-key", KEY,
                         "--max-model-len", str(MAX_LEN)]).wait_ready()
    yield server
    server.stop_clean()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def systemone(server) -> dict:
    resp = httpx.post(server.url + "/v1/systemone", json=SYSTEMONE, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_same_decision(decision: dict, systemone: dict) -> None:
    """``decision`` (a Decisions body) answers exactly what ``systemone`` answers for SYSTEMONE."""
    urgent, team, severity = decision["answers"]
    ref = systemone["answers"]
    assert urgent == {"type": "predicate", "name": "urgent", "probability": ref["urgent"]["noul"]}
    assert team["type"] == "choice" and team["name"] == "team"
    assert team["choice"] == VALUES[ref["team"]["choice"]]
    assert team["probabilities"] == [{"value": VALUES[k], "probability": p} for k, p in ref["team"]["probabilities"].items()]
    assert team["confidence"] == gini(list(ref["team"]["probabilities"].values()))
    sev = ref["question_2"]
    assert severity["type"] == "score" and severity["name"] is None and severity["score"] == sev["score"]
    labels = ["No impact", "Minor", "Major", "Critical"]
    assert severity["probabilities"] == [{"value": i, "label": labels[i], "probability": p}
                                         for i, p in enumerate(sev["probabilities"].values())]
    assert severity["confidence"] == gini(list(sev["probabilities"].values()))
    tokens = systemone["usage"]["input_tokens"]
    assert decision["usage"] == {"input_tokens": tokens, "input_tokens_details": {"cached_tokens": 0,
                                 "cache_write_tokens": 0}, "output_tokens": 0,
                                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": tokens}
    assert decision["model"] == "clef-flash"


# --------------------------------------------------------------------------- the openai SDK


def test_sdk_answers_the_systemone_decision(client, systemone):
    raw = client.decisions.with_raw_response.create(model="clef-flash", input=STATE, questions=QUESTIONS)
    decision = raw.parse()
    assert decision._request_id == raw.headers["x-request-id"]
    assert_same_decision(decision.model_dump(mode="json"), systemone)
    # the body as sent on the wire, every key present (name: null for the unnamed question)
    assert_same_decision(json.loads(raw.text), systemone)
    assert json.loads(raw.text)["answers"][2]["name"] is None


def test_sdk_images_in_the_input_are_the_systemone_images(client, server):
    """An ``input_image`` part is the next SystemOne image and ``[image N]`` in the state: the same answer."""
    content = [{"type": "input_text", "text": STATE}, {"type": "input_image", "image_url": PNG_1X1, "detail": "auto"}]
    decision = client.decisions.create(model="clef-flash", questions=QUESTIONS,
                                       input=[{"role": "user", "content": content}])
    resp = httpx.post(server.url + "/v1/systemone", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json=SYSTEMONE | {"state": STATE + "\n[image 1]", "images": [PNG_1X1]})
    assert resp.status_code == 200, resp.text
    assert_same_decision(decision.model_dump(mode="json"), resp.json())
    plain = client.decisions.create(model="clef-flash", questions=QUESTIONS, input=STATE + "\n[image 1]")
    assert decision.usage.input_tokens == plain.usage.input_tokens + 64 + 3     # the image's block


def test_async_sdk_and_user_messages(server, systemone):
    """The async client; the caching and safety fields are accepted and change nothing."""
    async def ask():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            as_text = client.decisions.create(model="clef-flash", input=STATE, questions=QUESTIONS,
                                              prompt_cache_key="tickets", safety_identifier="user-42",
                                              prompt_cache_options={"mode": "implicit"})
            as_message = client.decisions.create(model="clef-flash", questions=QUESTIONS, input=[
                {"role": "user", "content": [{"type": "input_text", "text": STATE}]}])
            return await asyncio.gather(as_text, as_message)

    for decision in asyncio.run(ask()):
        assert_same_decision(decision.model_dump(mode="json"), systemone)


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["clef-flash", "@cf/cloudflare/clef-flash"]
    assert all(m.object == "model" and isinstance(m.created, int) and m.owned_by for m in models.data)
    assert client.models.retrieve("@cf/cloudflare/clef-flash").id == "@cf/cloudflare/clef-flash"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-6-luna")


def test_sdk_errors_are_typed(client, server):
    with pytest.raises(openai.AuthenticationError) as auth:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as other:
            other.decisions.create(model="clef-flash", input=STATE, questions=QUESTIONS)
    assert auth.value.code == "invalid_api_key"

    cases = [
        ({"questions": [QUESTIONS[0], {**QUESTIONS[1], "choices": [{"value": "true"}, {"value": True}]}]},
         "questions[1].choices[1].value", "invalid_value"),
        ({"questions": [QUESTIONS[0], {**QUESTIONS[0], "instructions": "again"}]}, "questions[1].name", "invalid_value"),
        ({"questions": [{**QUESTIONS[2], "levels": [{"label": "only"}]}]}, "questions[0].levels", "invalid_value"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                                 {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         "input[0].content[1]", "invalid_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
         "input[0].content[0]", "invalid_image"),                     # URLs are never fetched
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG_1X1, "detail": "high"}]}]},
         "input[0].content[0].detail", "unsupported_value"),
        ({"input": "word " * (2 * MAX_LEN)}, "input", "context_length_exceeded"),
        ({"extra_body": {"instuctions": "typo"}}, "instuctions", "invalid_value"),
    ]
    for change, param, code in cases:
        kwargs = {"model": "clef-flash", "input": STATE, "questions": QUESTIONS, **change}
        with pytest.raises(openai.BadRequestError) as err:
            client.decisions.create(**kwargs)
        assert (err.value.param, err.value.code, err.value.type) == (param, code, "invalid_request_error"), err.value.body
        assert err.value.message.startswith(f"Error code: 400 - {param}: ")


def test_bulk(server, systemone):
    good = {"model": "clef-flash", "input": STATE, "questions": QUESTIONS}
    body = (json.dumps(good) + "\n" + json.dumps({"model": "clef-flash", "input": STATE}) + "\n").encode()
    resp = httpx.post(server.url + "/v1/decisions/bulk", content=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-ndjson"})
    assert resp.status_code == 200, resp.text
    lines = [json.loads(line) for line in resp.text.splitlines()]
    records = {line["index"]: line for line in lines if "index" in line}
    assert lines[-1] == {"summary": {"records": 2, "ok": 1, "failed": 1, "aborted": None}}
    assert records[0]["status"] == 200
    assert_same_decision(records[0]["body"], systemone)
    assert records[1] == {"index": 1, "status": 400, "body": {"error": {
        "message": "questions: is required", "type": "invalid_request_error", "param": "questions",
        "code": "invalid_value"}}}


# --------------------------------------------------------------------------- LangChain


@pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")
def test_langchain_openai_decisions(server, systemone):
    from langchain_openai.chat_models.base import OpenAIContextOverflowError
    from langchain_openai.decisions import Choice, Level, OpenAIDecisions, Predicate, Score

    decisions = OpenAIDecisions(model="clef-flash", base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    request = {"input": STATE, "questions": {
        "urgent": Predicate(instructions="Is this support request urgent?"),
        "team": Choice(instructions="Which team should handle it?",
                       choices={"technical": "Outages, errors, and configuration",
                                "billing": "Payments, invoices, and refunds", False: None}),
        "question_2": Score(instructions="How severe?", levels=["No impact", "Minor",
                                                                Level(label="Major", description="Many users"),
                                                                "Critical"])}}
    async def ainvoke():
        try:
            return await decisions.ainvoke(request)
        finally:                 # its async client is made on this loop: close it before the loop ends
            await decisions._async_client.close()

    for response in (decisions.invoke(request), asyncio.run(ainvoke())):
        ref = systemone["answers"]
        assert response.request_id
        assert response.predicates["urgent"].probability == ref["urgent"]["noul"]
        team = response.choices["team"]
        assert team.probabilities == {VALUES[k]: p for k, p in ref["team"]["probabilities"].items()}
        assert team.confidence == gini(list(ref["team"]["probabilities"].values()))
        severity = response.scores["question_2"]
        assert severity.score == ref["question_2"]["score"]
        assert list(severity.probabilities.values()) == list(ref["question_2"]["probabilities"].values())
        assert response.usage.input_tokens == systemone["usage"]["input_tokens"]

    with pytest.raises(OpenAIContextOverflowError):
        decisions.invoke({**request, "input": "word " * (2 * MAX_LEN)})
    with pytest.raises(openai.BadRequestError) as err:
        decisions.invoke({**request, "questions": {"one": Score(instructions="x", levels=["a", "b"]),
                                                   "two": Choice(instructions="y", choices={"only": None})}})
    assert err.value.param == "questions[1].choices"


# --------------------------------------------------------------------------- offline API and the mapping


def test_offline_api_answers_as_the_route(tiny_release, client):
    from clef_vllm import Clef

    body = {"model": "clef-flash", "input": STATE, "questions": QUESTIONS}
    over_http = client.decisions.create(**body).model_dump(mode="json")
    with Clef(tiny_release, backend="reference", max_model_len=MAX_LEN) as clef:
        assert clef.decisions(body) == over_http
        with pytest.raises(RequestError) as err:
            clef.decisions_batch([body, {**body, "input": "word " * (2 * MAX_LEN)}])
    assert (err.value.kind, err.value.field) == (Kind.TOO_MANY_TOKENS, "requests[1].input")


def state_of(input_value) -> object:
    return parse_decision_request({"model": "m", "input": input_value, "questions": QUESTIONS[:1]}).request.state


def test_input_items_render_as_documented():
    assert state_of("plain") == "plain"
    assert state_of([{"role": "user", "content": "a"}, {"type": "message", "role": "user", "content": "b"}]) == "a\nb"
    assert state_of([{"role": "user", "content": [{"type": "input_json", "data": {"total": 3}}]}]) == {"total": 3}
    assert state_of([{"role": "user", "content": [{"type": "input_text", "text": "order"},
                                                  {"type": "input_json", "data": {"total": 3}}]}]) == ["order", {"total": 3}]
    assert state_of([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Refund me."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Looking."}], "phase": "commentary"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}", "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "paid"},
    ]) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund me."},
           {"role": "assistant", "content": "Looking."},
           {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
           {"type": "function_call_output", "call_id": "c1", "output": "paid"}]
    with pytest.raises(RequestError) as err:
        state_of([{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert err.value.field == "input[0].call_id"
    with pytest.raises(RequestError) as err:
        state_of([{"role": "system", "content": [{"type": "input_json", "data": {}}]}])
    assert err.value.field == "input[0].content[0].type"


def test_names_and_synthetic_ids():
    plan = parse_decision_request({"model": "m", "input": "x", "questions": [
        {"type": "predicate", "instructions": "a"}, {"type": "predicate", "name": "question_0", "instructions": "b"},
        {"type": "predicate", "instructions": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}]}]})
    assert list(plan.request.questions) == ["question_0_", "question_0", "question_2"]
    assert plan.request.questions["question_2"].instructions == "c\nd"
    with pytest.raises(RequestError) as err:
        parse_decision_request({"model": "m", "input": "x", "questions": [
            {"type": "predicate", "instructions": [{"type": "input_image", "image_url": "https://x/y.png"}]}]})
    assert (err.value.kind, err.value.field) == (Kind.UNSUPPORTED, "questions[0].instructions[0]")


# --------------------------------------------------------------------------- hostile bodies

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)
PARTS = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_json", "input_image", "output_text",
                                                        "refusal", "x"])}, optional={
    "text": JSON_VALUES, "data": JSON_VALUES, "image_url": JSON_VALUES, "refusal": JSON_VALUES})
ITEMS = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "custom_tool_call", "other"]),
    "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
    "content": st.text(max_size=8) | st.lists(PARTS, max_size=3) | JSON_VALUES,
    "call_id": st.sampled_from(["c1", "c2"]) | JSON_VALUES, "name": JSON_VALUES, "arguments": JSON_VALUES,
    "output": st.text(max_size=8) | st.lists(PARTS, max_size=2)})
HOSTILE_QUESTIONS = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["predicate", "choice", "score", "noul"]) | JSON_VALUES,
    "name": st.sampled_from(["a", "b", ""]) | JSON_VALUES,
    "instructions": st.text(max_size=8) | st.lists(PARTS, max_size=2) | JSON_VALUES,
    "choices": st.lists(st.fixed_dictionaries({"value": st.sampled_from(["x", "true", True, False, 1])},
                                              optional={"description": JSON_VALUES}), max_size=4) | JSON_VALUES,
    "levels": st.lists(st.fixed_dictionaries({"label": st.text(max_size=4) | JSON_VALUES}), max_size=4) | JSON_VALUES})
HOSTILE = st.fixed_dictionaries({}, optional={
    "model": st.just("clef-flash") | JSON_VALUES, "input": st.text(max_size=8) | st.lists(ITEMS, max_size=4) | JSON_VALUES,
    "questions": st.lists(HOSTILE_QUESTIONS, max_size=4) | JSON_VALUES,
    "safety_identifier": JSON_VALUES, "prompt_cache_options": JSON_VALUES, "extra": JSON_VALUES})


@settings(deadline=None, derandomize=True, database=None, max_examples=120,
          suppress_health_check=list(HealthCheck))
@given(body=HOSTILE | JSON_VALUES)
def test_hostile_bodies_get_an_openai_error_never_a_500(body, server):
    resp = httpx.post(server.url + "/v1/decisions", content=json.dumps(body), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert resp.status_code in (200, 400, 413), resp.text
    data = resp.json()
    if resp.status_code == 200:
        assert len(data["answers"]) == len(body["questions"])
        return
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", data
    assert isinstance(error["code"], str) and error["message"].startswith(f"{error['param']}: " if error["param"] else "")
