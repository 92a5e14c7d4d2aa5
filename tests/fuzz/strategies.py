"""Hypothesis strategies for SystemOne requests, valid and hostile, and the checks every response
must pass. Shared by tests/test_fuzz.py (CI, a few hundred examples) and tests/fuzz/run_long.py.

Hostile parts: any Unicode (lone surrogates included, sent as ``\\udXXX`` escapes or as invalid
UTF-8), the tokenizer's special tokens, control characters, huge and tiny numbers (up to Python's
4,300-digit limit and beyond), deep nesting (up to past the JSON decoder's limit), odd question
ids, unknown fields, media, wrong types, truncated and corrupted bytes.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "<|image_pad|>", "STATE:",
           "SCHEMA FIELDS:", "END FIELD", "\nFIELD 1\nID: x\nTYPE: noul\nINSTRUCTION: ", "OPTION 1: "]
ODD_TEXT = ["", " ", "\x00", "\u2028", "\u202e", "\ufeff", "\ud800", "\udfff", "\ud83d\ude00", "🎉" * 40, "a" * 300,
            "日本語のテキスト", "null", "true", "__proto__", "constructor", "hold.x", "q.1", "a b", "\\", "\"", "%s%n",
            "\r\n", "\t" * 20]

# Any code point, lone surrogates included (JSON-escaped on the wire).
any_char = st.characters(blacklist_categories=())
text = st.one_of(
    st.text(any_char, max_size=40),
    st.text(st.characters(), max_size=200),
    st.sampled_from(SPECIAL + ODD_TEXT),
    st.lists(st.sampled_from(SPECIAL + ["word", " ", "ü"]), max_size=20).map("".join),
)
ints = st.one_of(st.integers(), st.integers(min_value=-(10 ** 40), max_value=10 ** 40),
                 st.sampled_from([0, -1, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 4299, -(10 ** 4299)]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 5e-324, 1.7976931348623157e308, 1e-300, 1e300]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=6),
                                                           st.dictionaries(text, kids, max_size=6)),
                           max_leaves=40)

question_ids = st.one_of(st.text(st.characters(), min_size=1, max_size=30), st.sampled_from(ODD_TEXT),
                         st.from_regex(r"[A-Za-z0-9_.\-]{1,100}", fullmatch=True), text)
option_ids = st.one_of(st.text(st.characters(), min_size=1, max_size=20), st.sampled_from(ODD_TEXT + SPECIAL))


def _question(kind: str | None) -> st.SearchStrategy[dict]:
    criteria = {
        "noul": st.one_of(st.none(), st.dictionaries(st.sampled_from(["true", "false"]), json_values, max_size=2),
                          st.dictionaries(text, json_values, max_size=3)),
        "choice": st.one_of(st.dictionaries(option_ids, json_values, min_size=1, max_size=10),
                            st.integers(200, 300).map(lambda n: {f"o{i}": None for i in range(n)}),
                            json_values),
        "score": st.one_of(st.lists(json_values, min_size=1, max_size=12), json_values),
    }
    kinds = st.sampled_from(["noul", "choice", "score"]) if kind is None else st.just(kind)

    def build(k):
        return st.fixed_dictionaries({"type": st.just(k)},
                                     optional={"instructions": st.one_of(text, json_values),
                                               "criteria": criteria[k], "extra": json_values})

    typed = kinds.flatmap(build)
    return st.one_of(typed, typed, typed, st.dictionaries(text, json_values, max_size=4),
                     st.fixed_dictionaries({"type": text}), json_values)


questions = st.dictionaries(question_ids, _question(None), max_size=8)
well_formed_questions = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True),
                                        _question(None).filter(lambda q: isinstance(q, dict) and q.get("type") in
                                                               ("noul", "choice", "score")), min_size=1, max_size=6)

requests = st.fixed_dictionaries(
    {"model": st.one_of(text, text, json_values), "state": json_values,
     "questions": st.one_of(questions, questions, well_formed_questions, json_values)},
    optional={"images": st.one_of(st.lists(text, max_size=2), json_values),
              "videos": st.one_of(st.lists(text, max_size=1), json_values),
              "id": json_values, "media_kwargs": json_values, "stream": json_values})


# Requests that pass validation but carry hostile content: they must be answered (200), or refused
# with 413 when their schema alone exceeds the token limit.
safe_char = st.characters(blacklist_categories=("Cs",))
safe_text = st.one_of(st.text(safe_char, max_size=60), st.sampled_from(SPECIAL + [t for t in ODD_TEXT if not any(
    0xD800 <= ord(c) <= 0xDFFF for c in t)]))
safe_json = st.recursive(st.one_of(st.none(), st.booleans(), ints, floats, safe_text),
                         lambda kids: st.one_of(st.lists(kids, max_size=6), st.dictionaries(safe_text, kids, max_size=6)),
                         max_leaves=40)
long_state = st.one_of(st.integers(0, 6000).map(lambda n: "word " * n),
                       st.integers(0, 3000).map(lambda n: "<|im_end|>日本" * n),
                       st.integers(0, 500).map(lambda n: {"rows": [{"id": i, "v": i * 0.5, "t": "ü"} for i in range(n)]}))
_instructions = st.one_of(st.none(), safe_text, safe_json)
valid_question = st.one_of(
    st.fixed_dictionaries({"type": st.just("noul")}, optional={
        "instructions": _instructions,
        "criteria": st.one_of(st.none(), st.dictionaries(st.sampled_from(["true", "false"]), safe_json, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("choice"),
                           "criteria": st.dictionaries(st.text(safe_char, min_size=1, max_size=20), safe_json,
                                                       min_size=1, max_size=12)},
                          optional={"instructions": _instructions}),
    st.fixed_dictionaries({"type": st.just("score"), "criteria": st.lists(safe_json, min_size=1, max_size=12)},
                          optional={"instructions": _instructions}),
)
valid_requests = st.fixed_dictionaries(
    {"model": safe_text, "state": st.one_of(safe_json, safe_json, long_state),
     "questions": st.dictionaries(st.text(safe_char, min_size=1, max_size=40), valid_question, min_size=1,
                                  max_size=8)},
    optional={"id": safe_json, "metadata": safe_json})


def check_valid_response(status: int, body_bytes: bytes, sent: dict) -> str | None:
    """A valid request is answered, or refused with 413 because its schema alone is too long (counted
    in tokens, or already in characters: a structural limit that no fitting schema reaches)."""
    body = json.loads(body_bytes)
    if status == 413 and ("schema requires" in body["error"]["message"] or "fit in" in body["error"]["message"]):
        return None
    if status != 200:
        return f"a valid request got HTTP {status}: {body}"
    if list(body["answers"]) != list(sent["questions"]) or body["model"] != sent["model"]:
        return "answers or model do not match the request"
    if body["usage"]["truncated_state_tokens"] < 0 or body["usage"]["input_tokens"] <= 0:
        return f"usage {body['usage']}"
    return None


def _nested(depth: int, kind: str) -> bytes:
    inner = b"[" * depth + b"]" * depth if kind == "list" else b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"model":"m","state":' + inner + b',"questions":{"q":{"type":"noul"}}}'


def _mutate(data: bytes, where: int, how: int, byte: int) -> bytes:
    if not data:
        return bytes([byte])
    i = where % len(data)
    if how == 0:
        return data[:i]                                   # truncated
    if how == 1:
        return data[:i] + bytes([byte]) + data[i:]         # inserted byte (often invalid UTF-8)
    if how == 2:
        return data[:i] + data[i + 1:]                     # deleted byte
    return data[:i] + bytes([byte]) + data[i + 1:]         # replaced byte


def encode_body(obj: Any, ascii_only: bool) -> bytes:
    """JSON bytes; without ``ascii_only`` lone surrogates become invalid UTF-8 (surrogatepass)."""
    text_ = json.dumps(obj, ensure_ascii=ascii_only)
    return text_.encode("utf-8", "surrogatepass")


raw_bodies = st.one_of(
    st.builds(encode_body, requests, st.booleans()),
    st.builds(encode_body, requests, st.just(True)),
    st.builds(encode_body, json_values, st.booleans()),
    st.builds(_nested, st.integers(1, 1200), st.sampled_from(["list", "dict"])),
    st.builds(_mutate, st.builds(encode_body, requests, st.just(True)), st.integers(0, 10 ** 6), st.integers(0, 3),
              st.integers(0, 255)),
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"model":"m"}', b"NaN", b'{"model":"m","state":1e999,"questions":{}}',
                     b'{"model":"m","state":"x","questions":{"q":{"type":"noul"}},"questions":{}}']),
)


def check_response(status: int, headers, body_bytes: bytes, sent: bytes, dialect: str = "reference") -> str | None:
    """``None`` if the response is acceptable for what was sent, else what is wrong."""
    if status >= 500:
        return f"HTTP {status}: {body_bytes[:300]!r}"
    if "x-request-id" not in headers or "server-timing" not in headers:
        return "missing X-Request-Id or Server-Timing"
    try:
        body = json.loads(body_bytes)
    except ValueError:
        return f"HTTP {status} body is not JSON: {body_bytes[:200]!r}"
    if status != 200:
        ok = (set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
              and body["error"]["code"] == status) if dialect == "reference" else body.get("success") is False
        return None if ok else f"HTTP {status} error body has the wrong shape: {body}"
    try:
        request = json.loads(sent)
    except ValueError:
        return "a body that is not JSON was answered 200"
    result = body["result"] if dialect != "reference" else body
    if list(result["answers"]) != list(request["questions"]):
        return "answers are not the request's questions in order"
    if result["model"] != request["model"]:
        return "model is not echoed"
    return None


def check_encoding(encoder, body) -> None:
    """parse -> encode -> answers for one decoded body; only RequestError may escape."""
    import torch

    from clef_vllm.schema.answers import build_response
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.errors import Kind
    from clef_vllm.schema.protocol import RequestError
    from clef_vllm.server.errors import error_body, outcome

    try:
        parsed = parse_request(body, limits=encoder.request_limits())
    except RequestError as exc:
        assert 400 <= outcome(exc).status < 500 and str(exc)
        json.dumps(error_body(exc), ensure_ascii=False).encode("utf-8")   # the error body is always encodable
        return
    try:
        enc = encoder.encode(parsed)
    except RequestError as exc:
        assert exc.kind is Kind.SCHEMA_TOO_LONG and "schema requires" in exc.message
        return
    assert enc.num_tokens <= encoder.max_length and enc.truncated_state_tokens >= 0
    assert [f.question_id for f in enc.fields] == list(parsed.questions)
    prefix = len(encoder.prefix_ids)
    assert enc.schema_offset == prefix + enc.state_tokens
    for f in enc.fields:
        start, end = f.question_span
        assert enc.schema_offset <= start < end <= enc.num_tokens
        assert len(f.option_ids) == len(f.option_spans) >= 1
        assert all(end <= a < b <= enc.num_tokens for a, b in f.option_spans)
    probs = torch.cat([torch.full((len(f.option_ids),), 1.0 / len(f.option_ids)) for f in enc.fields])
    answer = build_response(parsed, enc, probs)
    assert list(answer["answers"]) == list(parsed.questions)
    json.dumps(answer, ensure_ascii=False).encode("utf-8")                 # the response is always encodable
