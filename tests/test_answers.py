"""Answer mapping (docs/encoding-and-head.md, "Answers"): shapes, key order, argmax tie rule, Python rounding, confidence."""

from __future__ import annotations

import json

import pytest
import torch

from clef_vllm.schema.answers import build_answer, build_response, gini_purity, hosted_envelope
from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import EncodedField, EncodedRequest
from clef_vllm.schema.protocol import Dialect

REF, WAI = Dialect.REFERENCE, Dialect.WORKERS_AI


def question(q: dict):
    return parse_request({"model": "m", "state": None, "questions": {"q": q}}).questions["q"]


def choice(*keys):
    return question({"type": "choice", "instructions": "x", "criteria": {k: f"d{k}" for k in keys}})


def test_noul_shape_is_type_then_p_true_without_confidence():
    ans = build_answer(question({"type": "noul"}), ("true", "false"), [0.73456, 0.26544], REF)
    assert ans == {"type": "noul", "noul": 0.7346}
    assert list(ans) == ["type", "noul"]
    assert build_answer(question({"type": "noul"}), ("true", "false"), [0.73456, 0.26544], WAI) == ans


def test_choice_shape_and_request_key_order():
    q = choice("technical", "billing", "sales")                  # request order
    encoded_order = ("billing", "sales", "technical")            # sorted, as encoded
    ans = build_answer(q, encoded_order, [0.2, 0.1, 0.7], REF)
    assert list(ans) == ["type", "choice", "confidence", "probabilities"]
    assert ans == {"type": "choice", "choice": "technical", "confidence": 0.7,
                   "probabilities": {"technical": 0.7, "billing": 0.2, "sales": 0.1}}
    assert list(ans["probabilities"]) == ["technical", "billing", "sales"]


def test_choice_ties_go_to_the_first_option_in_request_order():
    q = choice("zeta", "alpha", "mid")
    ans = build_answer(q, ("alpha", "mid", "zeta"), [0.4, 0.2, 0.4], REF)
    assert ans["choice"] == "zeta"
    q = choice("alpha", "zeta", "mid")
    assert build_answer(q, ("alpha", "mid", "zeta"), [0.4, 0.2, 0.4], REF)["choice"] == "alpha"


def test_argmax_uses_unrounded_probabilities():
    q = choice("b", "a")                                   # b first in request order
    ans = build_answer(q, ("a", "b"), [0.500049, 0.499951], REF)
    assert ans["probabilities"] == {"b": 0.5, "a": 0.5}   # a tie after rounding...
    assert ans["choice"] == "a"                          # ...but not before
    assert ans["confidence"] == 0.5


@pytest.mark.parametrize("p", [0.00015, 0.00025, 0.12345, 0.99995, 0.00005, 1 / 3, 0.0, 1.0, 0.123456789])
def test_rounding_is_pythons_round_4(p):
    ans = build_answer(question({"type": "noul"}), ("true", "false"), [p, 1 - p], REF)
    assert ans["noul"] == round(p, 4)
    assert json.dumps(ans["noul"]) == json.dumps(round(p, 4))


def test_rounding_of_float32_probabilities_uses_their_exact_value():
    p = torch.tensor([0.12345, 0.87655], dtype=torch.float32)
    ans = build_answer(question({"type": "noul"}), ("true", "false"), p.tolist(), REF)
    assert ans["noul"] == round(float(p[0]), 4)
    assert 0.00015 != 0.0002 and round(0.00015, 4) == 0.0001   # binary value, not decimal half-up


def test_score_expectation_legend_and_key_order():
    levels = ["Can wait", {"label": "week"}, None]
    q = question({"type": "score", "instructions": "x", "criteria": levels})
    probs = [0.03, 0.1548, 0.8152]
    ans = build_answer(q, ("0", "1", "2"), probs, REF)
    assert list(ans) == ["type", "score", "confidence", "legend", "probabilities"]
    assert ans["score"] == round(0 * 0.03 + 1 * 0.1548 + 2 * 0.8152, 4) == 1.7852
    assert ans["confidence"] == 0.8152
    assert ans["legend"] == {"0": "Can wait", "1": {"label": "week"}, "2": None}
    assert ans["probabilities"] == {"0": 0.03, "1": 0.1548, "2": 0.8152}


def test_score_uses_full_precision_before_rounding():
    q = question({"type": "score", "instructions": "x", "criteria": ["a", "b"]})
    ans = build_answer(q, ("0", "1"), [0.499994, 0.500006], REF)
    assert ans["score"] == round(0.500006, 4) == 0.5
    assert ans["probabilities"] == {"0": 0.5, "1": 0.5}


def test_workers_ai_confidence_is_gini_purity_of_rounded_probabilities():
    q = choice("a", "b", "c")
    probs = [0.6, 0.3, 0.1]
    ans = build_answer(q, ("a", "b", "c"), probs, WAI)
    expected = (3 * (0.36 + 0.09 + 0.01) - 1) / 2
    assert ans["confidence"] == round(expected, 4) == 0.19
    assert build_answer(q, ("a", "b", "c"), probs, REF)["confidence"] == 0.6
    assert gini_purity([1.0, 0.0]) == 1.0
    assert gini_purity([0.5, 0.5]) == 0.0
    assert gini_purity([1.0]) == 1.0
    assert 0.0 <= gini_purity([0.34, 0.33, 0.33]) < 1e-3
    levels = question({"type": "score", "instructions": "x", "criteria": [0, 1]})
    assert build_answer(levels, ("0", "1"), [0.9, 0.1], WAI)["confidence"] == round(2 * (0.81 + 0.01) - 1, 4)


def test_build_response_body():
    req = parse_request({"model": "clef-flash-test", "state": "s", "questions": {
        "z": {"type": "noul"}, "a": {"type": "choice", "criteria": {"y": 1, "x": 2}},
        "m": {"type": "score", "criteria": ["lo", "hi"]}}})
    fields = [EncodedField("z", "noul", (1, 2), ("true", "false"), ((2, 3), (3, 4))),
              EncodedField("a", "choice", (4, 5), ("x", "y"), ((5, 6), (6, 7))),
              EncodedField("m", "score", (7, 8), ("0", "1"), ((8, 9), (9, 10)))]
    enc = EncodedRequest(list(range(123)), fields, state_tokens=5, truncated_state_tokens=7)
    probs = torch.tensor([0.9, 0.1, 0.25, 0.75, 0.4, 0.6])
    body = build_response(req, enc, probs)
    assert list(body) == ["model", "answers", "usage"]
    assert body["model"] == "clef-flash-test"
    assert list(body["answers"]) == ["z", "a", "m"]
    assert body["answers"]["a"]["choice"] == "y" and list(body["answers"]["a"]["probabilities"]) == ["y", "x"]
    assert body["answers"]["a"]["probabilities"] == {"y": 0.75, "x": 0.25}
    assert body["answers"]["m"]["score"] == 0.6
    assert body["usage"] == {"input_tokens": 123, "output_tokens": 0, "truncated_state_tokens": 7,
                             "cached_state_tokens": 0}
    assert list(body["usage"])[:2] == ["input_tokens", "output_tokens"]
    assert hosted_envelope(body) == {"result": body, "success": True, "errors": [], "messages": []}
    json.dumps(body, allow_nan=False)
