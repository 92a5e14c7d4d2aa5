"""SystemOne request validation: both dialects, every rule.

Each refusal is checked for its error kind, the dotted field it names and the gist of its
message; each acceptance for what the parsed request keeps (question order, unknown fields).
The structural limits (JSON values, nesting, questions, options, characters) are checked here too;
how kinds become HTTP statuses is tests/test_server_api.py's business (server/errors.py).
"""

from __future__ import annotations

import copy
import json

import pytest

from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.errors import Kind
from clef_vllm.schema.protocol import (ChoiceQuestion, Dialect, NoulQuestion, RequestError, RequestLimits,
                                       ScoreQuestion, SystemOneRequest, question_field)

REF, WAI = "reference", "workers-ai"


def body(**questions) -> dict:
    """A valid request with the given questions (default: one of each type)."""
    if not questions:
        questions = {
            "urgent": {"type": "noul", "instructions": "Is this urgent?"},
            "team": {"type": "choice", "instructions": "Which team?",
                     "criteria": {"technical": "Outages", "billing": "Payments"}},
            "severity": {"type": "score", "instructions": "How severe?", "criteria": ["none", "minor", "major"]},
        }
    return {"model": "clef-flash", "state": "Checkout is down.", "questions": questions}


def refused(data, dialect=REF, *, kind=Kind.INVALID, field=None, message=None, limits="default") -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(data, dialect) if limits == "default" else parse_request(data, dialect, limits)
    err = info.value
    assert err.kind is kind, str(err)
    assert err.field == field, str(err)
    if message is not None:
        assert message in err.message, str(err)
    assert isinstance(err, ValueError)  # the offline API's contract: a ValueError naming the problem
    return err


def noul(**kw):
    return {"type": "noul", "instructions": "Is it?", **kw}


def choice(n=2, **kw):
    return {"type": "choice", "instructions": "Which?", "criteria": {f"o{i}": f"option {i}" for i in range(n)}, **kw}


def score(n=3, **kw):
    return {"type": "score", "instructions": "How much?", "criteria": [f"level {i}" for i in range(n)], **kw}


# --------------------------------------------------------------------------- accepted requests


@pytest.mark.parametrize("dialect", [REF, WAI])
def test_valid_request_parses_into_typed_questions(dialect):
    req = parse_request(body(), dialect)
    assert isinstance(req, SystemOneRequest)
    assert req.model == "clef-flash" and req.state == "Checkout is down."
    assert isinstance(req.questions["urgent"], NoulQuestion)
    assert isinstance(req.questions["team"], ChoiceQuestion)
    assert isinstance(req.questions["severity"], ScoreQuestion)
    assert list(req.questions["team"].criteria) == ["technical", "billing"]   # request order kept
    assert req.questions["severity"].criteria == ["none", "minor", "major"]


@pytest.mark.parametrize("dialect", [REF, WAI])
def test_question_order_is_the_wire_order(dialect):
    ids = ["zeta", "alpha", "mid", "b", "a", "Z", "10", "9"]
    raw = json.dumps(body(**{q: noul() for q in ids}))   # what the server receives
    req = parse_request(json.loads(raw), dialect)
    assert list(req.questions) == ids
    crit = {"zz": 1, "aa": 2, "mm": 3}
    req = parse_request(body(q=choice(criteria=crit)), dialect)
    assert list(req.questions["q"].criteria) == ["zz", "aa", "mm"]


@pytest.mark.parametrize("state", [None, 0, -1.5, 1250.0, True, False, "", "text", [], [1, [2]], {}, {"a": {"b": None}}])
def test_state_may_be_any_json_value_including_null(state):
    data = body()
    data["state"] = state
    assert parse_request(data).state == state


@pytest.mark.parametrize("instructions", [None, "", 0, False, {}, [], {"question": "q", "x": [1]}, "text", 1.5])
def test_reference_accepts_any_json_instructions_or_none(instructions):
    q = {"type": "noul", "instructions": instructions}
    assert parse_request(body(q=q)).questions["q"].instructions == instructions
    assert parse_request(body(q={"type": "noul"})).questions["q"].instructions is None


def test_noul_criteria_are_optional_and_may_override_true_false_or_be_null():
    for criteria in (None, {}, {"true": "yes"}, {"false": None}, {"true": {"x": 1}, "false": [1, 2]}):
        q = parse_request(body(q=noul(criteria=criteria))).questions["q"]
        assert q.criteria == criteria


def test_choice_descriptions_may_be_any_json_or_null():
    crit = {"a": None, "b": {"x": 1}, "c": [1, "two"], "d": 3, "e": "text", "f": False}
    assert parse_request(body(q=choice(criteria=crit))).questions["q"].criteria == crit
    levels = [None, {"x": 1}, 2, "three"]
    assert parse_request(body(q=score(criteria=levels))).questions["q"].criteria == levels


def test_reference_ignores_unknown_fields_everywhere():
    data = body(q=noul(weight=3, nested={"x": 1}))
    data.update(id="rec-1", media_kwargs={"max_pixels": 1}, temperature=0.5, extra={"a": 1})
    req = parse_request(data, REF)
    assert list(req.questions) == ["q"]
    assert req.model == "clef-flash"


def test_reference_has_no_upper_limits():
    data = body(**{f"q{i}": noul() for i in range(200)})
    assert len(parse_request(data).questions) == 200
    assert len(parse_request(body(q=choice(300))).questions["q"].criteria) == 300
    assert len(parse_request(body(q=score(40))).questions["q"].criteria) == 40
    # one option / one level is enough for the reference (criteria must only be truthy)
    parse_request(body(q=choice(1)))
    parse_request(body(q=score(1)))
    # any string is a question id in the reference dialect
    parse_request(body(**{"a b": noul(), "x" * 300: noul(), "é/ü?": noul()}))


@pytest.mark.parametrize("dialect", [REF, WAI])
def test_empty_media_lists_are_accepted(dialect):
    parse_request(body() | {"images": []}, dialect)
    parse_request(body() | {"images": None, "videos": []}, dialect)


def test_dialect_names():
    assert Dialect("reference") is Dialect.REFERENCE and Dialect("workers-ai") is Dialect.WORKERS_AI
    with pytest.raises(ValueError):
        parse_request(body(), "hosted")


# --------------------------------------------------------------------------- refusals shared by both dialects


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("data", [[], "text", 3, None, [body()]])
def test_body_must_be_an_object(dialect, data):
    refused(data, dialect, field=None, message="request body must be a JSON object")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("key", ["model", "state", "questions"])
def test_required_top_level_keys(dialect, key):
    data = body()
    del data[key]
    refused(data, dialect, field=key, message="is required")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("value", [None, 1, ["m"], {"m": 1}, True])
def test_model_must_be_a_string(dialect, value):
    data = body()
    data["model"] = value
    refused(data, dialect, field="model", message="must be a string")


@pytest.mark.parametrize("dialect", [REF, WAI])
def test_at_least_one_question(dialect):
    refused(body(**{}) | {"questions": {}}, dialect, field="questions", message="at least one question is required")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("value", [[], [{"type": "noul"}], "q", 1, None])
def test_questions_must_be_an_object(dialect, value):
    data = body()
    data["questions"] = value
    refused(data, dialect, field="questions", message="must be an object")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("value", ["noul", 1, None, ["noul"]])
def test_each_question_must_be_an_object(dialect, value):
    refused(body(team=value), dialect, field="questions.team", message="must be an object")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("question", [{"instructions": "x"}, {"type": "multi"}, {"type": "NOUL"}, {"type": 1},
                                      {"type": None}, {"type": ["noul"]}])
def test_type_must_be_noul_choice_or_score(dialect, question):
    refused(body(team=question), dialect, field="questions.team.type", message="type must be noul, choice, or score")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("qtype", ["choice", "score"])
def test_choice_and_score_criteria_are_required_and_not_empty(dialect, qtype):
    empty = {} if qtype == "choice" else []
    refused(body(team={"type": qtype, "instructions": "x"}), dialect, field="questions.team.criteria",
            message="is required")
    refused(body(team={"type": qtype, "instructions": "x", "criteria": empty}), dialect,
            field="questions.team.criteria", message="must not be empty")
    refused(body(team={"type": qtype, "instructions": "x", "criteria": None}), dialect,
            field="questions.team.criteria")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("criteria", [["a", "b"], "ab", 1, True])
def test_choice_criteria_must_be_an_object(dialect, criteria):
    refused(body(team={"type": "choice", "instructions": "x", "criteria": criteria}), dialect,
            field="questions.team.criteria", message="must be an object")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("criteria", [{"0": "a", "1": "b"}, "ab", 1])
def test_score_criteria_must_be_an_array(dialect, criteria):
    refused(body(team={"type": "score", "instructions": "x", "criteria": criteria}), dialect,
            field="questions.team.criteria", message="must be an array")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("criteria", [["true"], "true", 1])
def test_noul_criteria_must_be_an_object(dialect, criteria):
    refused(body(team=noul(criteria=criteria)), dialect, field="questions.team.criteria", message="must be an object")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("criteria, key", [({"yes": "x"}, "yes"), ({"true": "x", "maybe": "y"}, "maybe"),
                                           ({"True": "x"}, "True"), ({"1": "x", "false": "y"}, "1")])
def test_noul_criteria_keys_other_than_true_false_are_refused(dialect, criteria, key):
    err = refused(body(team=noul(criteria=criteria)), dialect, field="questions.team.criteria")
    assert repr(key) in err.message and '"true" or "false"' in err.message


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("media", ["images", "videos"])
def test_non_empty_media_is_validated_when_parsed(dialect, media):
    data = body()
    data[media] = ["data:image/png;base64,iVBORw0KGgo="]        # a PNG signature, no image: 422 naming the entry
    if media == "videos" and dialect == WAI:
        refused(data, dialect, kind=Kind.INVALID, field=media, message="unknown field")
    else:
        refused(data, dialect, kind=Kind.MEDIA_INVALID, field=f"{media}[0]")


@pytest.mark.parametrize("dialect", [REF, WAI])
def test_media_must_be_an_array(dialect):
    data = body()
    data["images"] = "data:image/png;base64,AAAA"
    refused(data, dialect, field="images", message="must be an array")


@pytest.mark.parametrize("dialect", [REF, WAI])
@pytest.mark.parametrize("where, field", [
    (lambda d: d.__setitem__("state", "ok \ud800 bad"), "state"),
    (lambda d: d.__setitem__("state", {"k": ["\udfff"]}), "state"),
    (lambda d: d.__setitem__("state", {"\ud83d": 1}), "state"),
    (lambda d: d.__setitem__("model", "clef\udc00"), "model"),
    (lambda d: d["questions"]["team"].__setitem__("instructions", "which \ud800"), "questions.team.instructions"),
    (lambda d: d["questions"]["team"].__setitem__("instructions", {"q": "\ud800"}), "questions.team.instructions"),
    (lambda d: d["questions"]["team"]["criteria"].__setitem__("technical", "\ud800"), "questions.team.criteria"),
    (lambda d: d["questions"]["team"]["criteria"].__setitem__("b\ud800", "x"), "questions.team.criteria"),
    (lambda d: d["questions"]["severity"]["criteria"].append("\udbff"), "questions.severity.criteria"),
])
def test_lone_surrogates_are_422_naming_the_field(dialect, where, field):
    data = copy.deepcopy(body())
    where(data)
    err = refused(data, dialect, field=field, message="unpaired UTF-16 surrogate")
    str(err).encode("utf-8")                                            # the error itself is encodable


def test_lone_surrogate_in_a_question_id_is_named_escaped():
    err = refused(body(**{"a\ud800": noul()}), REF, field='questions["a\\ud800"]', message="unpaired UTF-16 surrogate")
    str(err).encode("utf-8")
    # a proper surrogate PAIR (an emoji written as \ud83d\ude00 in JSON) is fine
    parse_request(json.loads('{"model":"m","state":"\\ud83d\\ude00","questions":{"q":{"type":"noul"}}}'))


def test_python_objects_that_are_not_json_are_refused():
    data = body()
    data["state"] = {"when": object()}
    refused(data, REF, field="state", message="not JSON-serialisable")


# --------------------------------------------------------------------------- reference-only refusals


@pytest.mark.parametrize("instructions", [None, ""])
def test_empty_question_id_needs_instructions(instructions):
    q = {"type": "noul"} if instructions is None else {"type": "noul", "instructions": instructions}
    refused(body(**{"": q}), REF, field='questions[""].instructions', message="empty question id")
    # with real instructions an empty id is accepted (the span is the instruction, not the id)
    assert list(parse_request(body(**{"": noul()})).questions) == [""]
    assert list(parse_request(body(**{"": {"type": "noul", "instructions": 0}})).questions) == [""]


# --------------------------------------------------------------------------- workers-ai limits


def test_workers_ai_question_count():
    assert len(parse_request(body(**{f"q{i}": noul() for i in range(64)}), WAI).questions) == 64
    refused(body(**{f"q{i}": noul() for i in range(65)}), WAI, field="questions", message="at most 64")
    assert len(parse_request(body(**{f"q{i}": noul() for i in range(65)}), REF).questions) == 65


@pytest.mark.parametrize("n, ok", [(1, False), (2, True), (255, True), (256, False)])
def test_workers_ai_choice_options(n, ok):
    data = body(q=choice(n))
    if ok:
        assert len(parse_request(data, WAI).questions["q"].criteria) == n
    else:
        refused(data, WAI, field="questions.q.criteria", message="2-255 options")
    parse_request(data, REF)


@pytest.mark.parametrize("n, ok", [(1, False), (2, True), (10, True), (11, False)])
def test_workers_ai_score_levels(n, ok):
    data = body(q=score(n))
    if ok:
        assert len(parse_request(data, WAI).questions["q"].criteria) == n
    else:
        refused(data, WAI, field="questions.q.criteria", message="2-10 levels")
    parse_request(data, REF)


@pytest.mark.parametrize("qid, ok", [
    ("a" * 100, True), ("a" * 101, False), ("A-z_0.9", True), ("a b", False), ("", False), ("naïve", False),
    ("a/b", False), ("a\n", False), ("tab\t", False), ("x:y", False), ("-._", True),
])
def test_workers_ai_question_id_pattern(qid, ok):
    data = body(**{qid: noul()})
    if ok:
        assert list(parse_request(data, WAI).questions) == [qid]
    else:
        refused(data, WAI, field=question_field(qid), message="[A-Za-z0-9_.-]{1,100}")


@pytest.mark.parametrize("question", [{"type": "noul"}, {"type": "noul", "instructions": None},
                                      {"type": "noul", "instructions": ""},
                                      {"type": "choice", "criteria": {"a": 1, "b": 2}},
                                      {"type": "score", "instructions": "", "criteria": [1, 2]}])
def test_workers_ai_requires_non_empty_instructions(question):
    refused(body(q=question), WAI, field="questions.q.instructions", message="required and must not be empty")
    parse_request(body(q=question), REF)


@pytest.mark.parametrize("instructions", [{"question": "q"}, 0, False, [], "x"])
def test_workers_ai_accepts_non_string_non_empty_instructions(instructions):
    parse_request(body(q={"type": "noul", "instructions": instructions}), WAI)


@pytest.mark.parametrize("extra, field", [
    ({"id": "x"}, "id"), ({"media_kwargs": {}}, "media_kwargs"), ({"temperature": 0}, "temperature"),
])
def test_workers_ai_refuses_unknown_top_level_fields(extra, field):
    refused(body() | extra, WAI, field=field, message="unknown field")


def test_workers_ai_refuses_unknown_question_fields():
    refused(body(q=noul(weight=2)), WAI, field="questions.q.weight", message="unknown field")
    refused(body(q=choice(2, description="x")), WAI, field="questions.q.description", message="unknown field")


# --------------------------------------------------------------------------- field paths


@pytest.mark.parametrize("qid, path", [("team", "questions.team.criteria"), ("a_b-1", "questions.a_b-1.criteria"),
                                       ("", 'questions[""].criteria'), ("a.b", 'questions["a.b"].criteria'),
                                       ("a b", 'questions["a b"].criteria'), ('say "hi"', 'questions["say \\"hi\\""].criteria'),
                                       ("é", 'questions["é"].criteria')])
def test_question_ids_in_field_paths_are_quoted_unless_plain(qid, path):
    refused(body(**{qid: {"type": "choice", "instructions": "x", "criteria": {}}}), REF, field=path,
            message="must not be empty")


# --------------------------------------------------------------------------- structural limits


def test_limits_are_sized_from_the_token_budget():
    small = RequestLimits.for_tokens(1024)
    assert small.max_values == 8 * 1024 + 64 and small.max_questions == 65 and small.max_options == 258
    assert small.max_schema_chars == 128 * 1024 and small.max_depth == 128
    assert RequestLimits.for_tokens(16384, max_token_bytes=16).max_schema_chars == 16 * 16384


def test_nesting_is_bounded_in_every_field():
    deep = []
    for _ in range(200):
        deep = [deep]
    for where, field in [(lambda d: d.__setitem__("state", deep), "state"),
                         (lambda d: d.__setitem__("extra", {"x": deep}), "extra"),
                         (lambda d: d["questions"]["team"].__setitem__("instructions", deep), "questions.team.instructions"),
                         (lambda d: d["questions"]["team"]["criteria"].__setitem__("billing", deep),
                          "questions.team.criteria"),
                         (lambda d: d["questions"]["severity"]["criteria"].append(deep), "questions.severity.criteria")]:
        data = copy.deepcopy(body())
        where(data)
        refused(data, REF, kind=Kind.TOO_COMPLEX, field=field, message="nested more than 128 levels deep")
    ok = []
    for _ in range(120):
        ok = [ok]
    parse_request(body() | {"state": ok})


def test_a_deeply_nested_level_is_refused_before_it_can_reach_the_answer():
    """D1: a score level nested ~963 deep passed parsing and broke the answer's serialisation (over
    HTTP: tests/adversarial); here 300 levels, which the test runner's own stack can decode."""
    raw = '{"model":"m","state":1,"questions":{"a":{"type":"score","criteria":[' + "[" * 300 + "]" * 300 + "]}}}"
    refused(json.loads(raw), REF, kind=Kind.TOO_COMPLEX, field="questions.a.criteria")


def test_json_value_count_question_option_and_character_limits():
    limits = RequestLimits.for_tokens(1024)
    refused(body() | {"state": list(range(9000))}, REF, kind=Kind.TOO_COMPLEX, field="state",
            message="more than 8256 JSON values", limits=limits)
    refused(body() | {"junk": {str(i): 0 for i in range(9000)}}, REF, kind=Kind.TOO_COMPLEX, field="junk",
            limits=limits)
    refused(body(**{f"q{i}": noul() for i in range(66)}), REF, kind=Kind.TOO_COMPLEX, field="questions",
            message="at most 65 questions fit in 1024 tokens", limits=limits)
    refused(body(q=choice(259)), REF, kind=Kind.TOO_COMPLEX, field="questions", message="at most 258 options",
            limits=limits)
    refused(body(q=noul(instructions="x" * (128 * 1024 + 1))), REF, kind=Kind.TOO_COMPLEX, field="questions",
            message="characters", limits=limits)
    refused(body() | {"model": "m" * 1001}, REF, kind=Kind.TOO_COMPLEX, field="model", message="at most 1000")
    parse_request(body(**{f"q{i}": noul() for i in range(65)}), REF, limits)
    parse_request(body() | {"state": "x" * 10_000_000}, REF, limits)     # a long state is cut, not refused
    parse_request(body() | {"state": list(range(9000))}, REF, None)     # None: no limits


def test_huge_python_integers_are_refused_not_crashing_the_renderer():
    refused(body() | {"state": {"n": 10 ** 5000}}, REF, field="state", message="more than 4300 digits")
    parse_request(body() | {"state": {"n": 10 ** 4000}})


# --------------------------------------------------------------------------- error bodies (server/errors.py)


def test_errors_know_nothing_of_http_and_the_server_table_maps_every_kind():
    from clef_vllm.server.errors import OUTCOMES, error_body

    assert set(OUTCOMES) == set(Kind)
    assert not hasattr(RequestError("x"), "status")
    err = refused(body(team={"type": "choice", "instructions": "x", "criteria": ["a"]}), REF,
                  field="questions.team.criteria")
    assert str(err) == "questions.team.criteria: must be an object"
    assert error_body(err) == error_body(err, REF) == {"error": {"message": "questions.team.criteria: must be an object",
                                                                 "type": "invalid_request_error",
                                                                 "param": "questions.team.criteria", "code": 422}}
    media = RequestError("not served: the server runs with --text-only", kind=Kind.UNSUPPORTED, field="images")
    assert error_body(media)["error"]["code"] == 400 and error_body(media)["error"]["param"] == "images"
    from clef_vllm.schema.errors import ServiceError

    assert error_body(ServiceError("boom"))["error"] == {"message": "boom", "type": "server_error", "param": None,
                                                         "code": 500}
    hosted = refused(body(**{f"q{i}": noul() for i in range(65)}), WAI, field="questions")
    assert error_body(hosted, WAI) == {"success": False, "errors": [{"code": 5012, "message": str(hosted)}],
                                       "messages": [], "result": None}
    assert error_body(media, WAI)["errors"][0]["code"] == 6003
    assert error_body(RequestError("too long", kind=Kind.SCHEMA_TOO_LONG), WAI)["errors"][0]["code"] == 5021
