"""Record encoding: a validated SystemOne request -> token ids + question/option spans (docs/encoding-and-head.md).

The prompt is built by tokenizing fixed text segments ONE AT A TIME (``add_special_tokens=False``)
and concatenating the id lists, so BPE merges never cross a segment boundary and every span
boundary is a segment boundary. Tokenizing the whole prompt at once gives different ids.

Work follows the token budget, not the body size: the schema is tokenized in batches and refused
as soon as it cannot fit; the state is rendered and tokenized only as far as the budget can use
(a prefix ending where the tokenizer provably starts a new piece, so its ids are exactly the first
ids of the whole state's tokenization, grown until it holds more tokens than can be kept).
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Sequence

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media import TEXT_ONLY, TypedMediaTokens, no_check, text_only
from clef_vllm.schema.media_inputs import MediaInputs, MediaProcessor
from clef_vllm.schema.protocol import (DEFAULT_MAX_TOKENS, TYPE_IDS, ChoiceQuestion, NoulQuestion, RequestLimits,
                                SystemOneRequest)
from clef_vllm.schema.state_text import StateText, render  # noqa: F401  (render: part of this module's API)
from clef_vllm.util.lru import SizedLRU

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX_TEXT = "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER_TEXT = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER_TEXT = "\nALLOWED OPTIONS:\n"
OPTION_END_TEXT = "\n"
FIELD_END_TEXT = "END FIELD\n"
SUFFIX_TEXT = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
DEFAULT_MAX_LENGTH = DEFAULT_MAX_TOKENS
#: Special tokens the fixed prompt text relies on; each must be ONE added token.
PROMPT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")

#: A state longer than 1.5 times this many characters is tokenized as pieces of about this size, in one
#: batched call (the Rust tokenizer encodes a batch on all cores; one long text uses one core).
#: The ids are exactly those of the whole state: see ``state_pieces``.
STATE_PIECE_CHARS = 4096
#: Token ids of state pieces kept, at most this many ids in all (4 bytes each: 32 MB) and
#: ``STATE_PIECE_CACHE // 64`` pieces, least recently used dropped: a state sent again, or a longer
#: one starting the same way, is tokenized only where its pieces differ (its last piece, cut where
#: this request's budget ends). Memory stays bounded whatever the states are made of.
STATE_PIECE_CACHE = 8_000_000
#: A state text of at least this many characters also keeps its whole ids list (Python ints), so the same
#: state sent again (a follow-up) is not cut, keyed and joined again (making 16k int objects from the
#: cached arrays was most of it): encoding a 16k-token follow-up 1.1 -> 0.45 ms on a 2-core machine
#: (bench/results/cpu_encode_follow_up_state_lists.txt). At most STATE_LIST_IDS ids (~40 bytes each with their list: ~10 MB; the text,
#: held as the key, counts one id per 40 characters) and STATE_LISTS states, least recently used dropped.
STATE_LIST_MIN_CHARS = 4 * STATE_PIECE_CHARS
STATE_LIST_IDS = 262_144
STATE_LISTS = 16
#: Token ids of schema segments (a field's header, its instruction, an option) kept by content, at most
#: this many ids in all or ``SCHEMA_SEGMENT_CACHE // 16`` segments, least recently used dropped:
#: clients ask the same questions about many states, so a schema seen before is not tokenized again.
SCHEMA_SEGMENT_CACHE = 1_000_000
#: Schema segments are tokenized in batches of about this many characters; a schema that already
#: cannot fit is refused before the rest is tokenized.
SCHEMA_BATCH_CHARS = 65536
#: First guess of characters per token when choosing how much of a long state to tokenize (grown
#: if the prefix turns out to hold too few tokens).
PREFIX_CHARS_PER_TOKEN = 6
#: A state with no place to cut within this many characters past the prefix it needs is refused:
#: that run would have to be tokenized whole (a million letters without a space, a digit or a
#: punctuation mark takes ~1 s of tokenizer time).
MAX_UNCUT_CHARS = 262144
#: Qwen3.5's pre-tokenizer regex (tokenizer.json). It never puts a space that follows a
#: non-space character anywhere but at the START of a piece, and always ends a piece after a run
#: of newlines followed by a letter; BPE then runs on each piece alone. So cutting the text there
#: cannot change the ids (the ASCII character after the cut also keeps NFC from composing across it).
QWEN_PRETOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Places where that regex always ends one piece and starts the next, whatever follows, and that
#: NFC never composes across (the character after the cut is ASCII and can never combine with what
#: precedes it). Each of these is checked against the whole-text tokenization in tests/test_encoding_pieces.py:
#:
#: * before a space + ASCII letter that follows printable ASCII (the space opens the word's piece);
#: * after a newline, before an ASCII letter (a run of newlines is a piece of its own);
#: * before an ASCII digit that follows a non-space (digits are pieces of one digit; a space before
#:   a digit could join a whitespace run, hence the non-space);
#: * before ASCII punctuation, or the common CJK punctuation marks, that follows a letter (a run of
#:   letters ends where punctuation starts; those marks are never part of an NFC composition).
#:
#: A cut is also never placed inside an added (special) token, which is matched before the regex.
_SAFE_CUT = re.compile(r"(?<=[!-~]) (?=[A-Za-z])|(?<=\n)(?=[A-Za-z])|(?<=\S)(?=[0-9])"
                       r"|(?<=[^\W\d_])(?=[!-/:-@\[-`{-~、。，．：；？！（）「」『』【】《》〈〉])")


def _inside_added_token(text: str, cut: int, added: Sequence[str]) -> bool:
    """Whether an occurrence of one of ``added`` spans position ``cut`` of ``text``."""
    for token in added:
        n = len(token)
        if n < 2:
            continue
        start = text.find(token, max(0, cut - n + 1), cut + n - 1)
        while start != -1 and start < cut:
            if start + n > cut:
                return True
            start = text.find(token, start + 1, cut + n - 1)
    return False


def safe_cut(text: str, start: int, end: int | None = None, added: Sequence[str] = ()) -> int | None:
    """The first safe place to cut ``text`` (see ``_SAFE_CUT``) at or after ``start`` and before ``end``."""
    end = len(text) if end is None else min(end, len(text))
    pos = start
    while pos < end:
        found = _SAFE_CUT.search(text, pos, end)
        if found is None:
            return None
        if not _inside_added_token(text, found.start(), added):
            return found.start()
        pos = found.start() + 1
    return None


def state_pieces(text: str, size: int = STATE_PIECE_CHARS, added: Sequence[str] = ()) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, only at the safe places of ``_SAFE_CUT``
    (never inside one of the ``added`` tokens); a text without such places stays whole."""
    pieces, start = [], 0
    while len(text) - start > size + size // 2:
        cut = safe_cut(text, start + size, added=added)
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class PieceCache(SizedLRU):
    """Token ids of texts tokenized on their own (state pieces, schema segments) by content (a 16-byte BLAKE2b
    digest of the text), least recently used dropped past ``capacity`` ids in all or ``max_pieces`` texts (default
    ``capacity // 64``). Thread-safe; tokenizing such a text is a pure function of the text."""

    def __init__(self, capacity: int = STATE_PIECE_CACHE, max_pieces: int | None = None):
        super().__init__(capacity, capacity // 64 if max_pieces is None else max_pieces)

    @staticmethod
    def key(piece: str) -> bytes:
        return hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        super().put(key, array("I", ids), len(ids))


def question_options(question) -> list[tuple[str, Any]]:
    """The ``(option_id, description)`` pairs of a question, in ENCODED order."""
    if isinstance(question, NoulQuestion):
        descriptions = dict(NOUL_DEFAULTS)
        descriptions.update(question.criteria or {})
        return [("true", descriptions["true"]), ("false", descriptions["false"])]
    if isinstance(question, ChoiceQuestion):
        return sorted(((str(k), v) for k, v in question.criteria.items()), key=lambda kv: kv[0])
    return [(str(i), level) for i, level in enumerate(question.criteria)]


def render_option(option_id: str, description: Any) -> str:
    """``{"description":...,"option_id":...}`` (sorted keys), without description when it is null."""
    obj = {"option_id": option_id}
    if description is not None:
        obj["description"] = description
    return render(obj)


def instruction_text(question_id: str, instructions: Any) -> str:
    """The instruction span's text: the question id only when instructions are missing, null or ""."""
    if instructions is None or (isinstance(instructions, str) and instructions == ""):
        return question_id
    return render(instructions)


@dataclass(frozen=True)
class EncodedField:
    """One question as the head sees it. Spans are absolute, half-open token ranges."""

    question_id: str
    type: str
    question_span: tuple[int, int]
    option_ids: tuple[str, ...]
    option_spans: tuple[tuple[int, int], ...]

    @property
    def type_id(self) -> int:
        return TYPE_IDS[self.type]


@dataclass
class EncodedRequest:
    """Token ids, field spans and usage of one request."""

    input_ids: list[int]
    fields: list[EncodedField]
    state_tokens: int
    truncated_state_tokens: int = 0
    schema_offset: int = 0
    #: False when the state was longer than could ever be used: only the part that fits was tokenized
    #: and ``truncated_state_tokens`` is estimated from the characters left out.
    truncation_exact: bool = True
    cached_state_tokens: int = 0        # set by the backend: leading tokens read from the state cache
    #: The request's images, processed (None: text only); their id block starts right after the prompt prefix.
    media: MediaInputs | None = field(default=None, repr=False)
    media_tokens: int = 0               # length of that block (start, pads and end per image, a newline)
    media_offset: int = 0               # where it starts (the prompt prefix's length)
    _lexical_ids: list[int] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def media_digest(self) -> bytes:
        """The digest of the request's images (empty for text): part of every key of its state."""
        return self.media.digest if self.media is not None else b""

    @property
    def lexical_ids(self) -> list[int]:
        """Token ids inside the option spans, in encoded option order (the lm_head rows the head reads)."""
        if self._lexical_ids is None:
            ids = self.input_ids
            self._lexical_ids = [t for f in self.fields for a, b in f.option_spans for t in ids[a:b]]
        return self._lexical_ids


class RequestEncoder:
    """Encodes validated requests with one tokenizer; constant segments are tokenized once."""

    def __init__(self, tokenizer, max_length: int = DEFAULT_MAX_LENGTH, max_state_tokens: int | None = None,
                 piece_cache: int = STATE_PIECE_CACHE, segment_cache: int = SCHEMA_SEGMENT_CACHE,
                 state_list_cache: int = STATE_LIST_IDS, media: MediaProcessor | None = None,
                 text_only: str = TEXT_ONLY):
        # A transformers fast tokenizer or a bare ``tokenizers.Tokenizer``; we call the Rust tokenizer directly
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)     # (batched, stateless: thread-safe)
        self._typed = TypedMediaTokens(self._tok)         # media tokens typed in text stay text (schema/media.py)
        self.max_length = int(max_length)
        self.max_state_tokens = max_state_tokens
        self._prefix = self.tokenize(PREFIX_TEXT)
        self._schema_header = self.tokenize(SCHEMA_HEADER_TEXT)
        self._options_header = self.tokenize(OPTIONS_HEADER_TEXT)
        self._option_end = self.tokenize(OPTION_END_TEXT)
        self._field_end = self.tokenize(FIELD_END_TEXT)
        self._suffix = self.tokenize(SUFFIX_TEXT)
        self._option_label = lru_cache(maxsize=1024)(lambda j: self.tokenize(f"OPTION {j}: "))
        self._check_tokenizer()
        self.split_state = self._pieces_are_exact()
        self._added = tuple(t.content for t in self._tok.get_added_tokens_decoder().values())
        self.max_token_bytes = self._longest_token_bytes()
        self.pieces = PieceCache(piece_cache)
        self.state_lists = SizedLRU(state_list_cache, STATE_LISTS)   # state text -> its ids (never changed)
        self.segments = PieceCache(segment_cache, max_pieces=segment_cache // 16)
        #: The checkpoint's image processor (None: requests with media are refused, saying ``text_only``).
        self.media = media
        self.text_only = text_only

    def _check_tokenizer(self) -> None:
        """Refuse a tokenizer that cannot encode the prompt (e.g. an empty one, which recent
        transformers builds silently when ``tokenizer.json`` is missing)."""
        for token in PROMPT_SPECIAL_TOKENS:
            if len(self.tokenize(token)) != 1:
                raise ValueError(f"the tokenizer does not have the special token {token} (Qwen3.5 tokenizer expected)")
        text = PREFIX_TEXT + SUFFIX_TEXT
        if self._tok.decode(self._prefix + self._suffix, skip_special_tokens=False) != text:
            raise ValueError("the tokenizer does not round-trip the prompt text (Qwen3.5 tokenizer expected)")

    def _pieces_are_exact(self) -> bool:
        """Whether ``state_pieces`` keeps the ids of this tokenizer: the Qwen3.5 normalizer and
        pre-tokenizer, and no added token with whitespace in it (one could span a cut)."""
        try:
            pre = json.loads(self._tok.pre_tokenizer.__getstate__())
            norm = self._tok.normalizer
            norm = json.loads(norm.__getstate__()) if norm is not None else None
            added = list(self._tok.get_added_tokens_decoder().values())
        except (AttributeError, TypeError, ValueError):
            return False
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return False
        split, byte_level = steps
        return (norm in (None, {"type": "NFC"})
                and split.get("type") == "Split" and split.get("pattern") == {"Regex": QWEN_PRETOKENIZER_REGEX}
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex")
                and not any(c.isspace() for t in added for c in t.content)
                and not any(t.lstrip or t.rstrip or t.single_word for t in added))

    def _longest_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for. In a byte-level vocabulary
        (what ``split_state`` checks) each character of a token is one byte; otherwise up to four."""
        longest = max(map(len, self._tok.get_vocab()), default=1)
        return longest if self.split_state else 4 * longest

    @classmethod
    def from_pretrained(cls, path: str | Path, *, images: str | None = None, pixels: bool = True,
                        **kwargs) -> "RequestEncoder":
        """Load the checkpoint's tokenizer (transformers AutoTokenizer, as the reference does). A local
        folder without ``tokenizer.json`` (nor ``vocab.json`` + ``merges.txt``) is refused by name: transformers
        would build an empty tokenizer from it, which fails later for a less telling reason.

        ``images``: ``None`` to encode images with the checkpoint's image processor (a folder without
        ``preprocessor_config.json`` has none), else why this encoder refuses them (e.g. ``"--text-only"``);
        ``pixels``: False where the backend runs the image processor itself (the encoder then decodes and checks
        the images, and keeps no pixel tensors)."""
        from transformers import AutoTokenizer

        folder = Path(path)
        if folder.is_dir() and not (folder / "tokenizer.json").is_file() and not (
                (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
            raise ValueError(f"no tokenizer.json in {folder} (the release ships the Qwen3.5 tokenizer.json next to "
                             "config.json: copy it there)")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if images is None and folder.is_dir():
            kwargs["media"] = MediaProcessor.from_pretrained(folder, tokenizer.backend_tokenizer, pixels=pixels)
            if kwargs["media"] is None:
                images = "the checkpoint has no image processor (preprocessor_config.json)"
        return cls(tokenizer, text_only=images or TEXT_ONLY, **kwargs)

    @property
    def prefix_ids(self) -> list[int]:
        return list(self._prefix)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one segment, no special tokens added (typed media tokens as text)."""
        return self._typed.encode_batch((text,))[0]

    def _tokenize_many(self, texts: Sequence[str]) -> list[list[int]]:
        return self._typed.encode_batch(texts)

    def request_limits(self, max_length: int | None = None) -> RequestLimits:
        """Structural limits for requests of at most ``max_length`` tokens (see :class:`RequestLimits`)."""
        return RequestLimits.for_tokens(self.max_length if max_length is None else max_length, self.max_token_bytes)

    def encode(self, request: SystemOneRequest, max_length: int | None = None,
               checkpoint: Callable[[], None] | None = None) -> EncodedRequest:
        """Token ids and absolute spans of ``request``.

        Raises RequestError(SCHEMA_TOO_LONG) as soon as the schema alone cannot fit, and
        RequestError(TOO_COMPLEX) for a state that cannot be cut where the budget ends (see
        ``MAX_UNCUT_CHARS``). ``checkpoint`` is called between steps (it raises to stop the work)."""
        max_length = self.max_length if max_length is None else int(max_length)
        check = checkpoint or no_check
        media_ids: list[int] = []
        if request._media:                # validated media (schema/media.py); pixels are processed once they fit
            if self.media is None:
                raise text_only(request._media, self.text_only)
            counts = self.media.token_counts(request._media, check)
            media_ids = self.media.block(counts)
        questions = list(request.questions.items())
        options = [question_options(q) for _, q in questions]

        # The fixed part of the schema costs this much whatever the texts say.
        base = len(self._prefix) + len(media_ids) + len(self._schema_header) + len(self._suffix)
        base += sum(len(self._options_header) + len(self._field_end) + len(self._option_end) * len(opts)
                    for opts in options)
        base += sum(len(self._option_label(j)) for opts in options for j in range(1, len(opts) + 1))

        # Every variable schema segment, per field: its header, its instruction, its option objects,
        # tokenized in batches; stop as soon as the schema cannot fit.
        texts = []
        for k, ((qid, q), opts) in enumerate(zip(questions, options), start=1):
            texts.append(f"\nFIELD {k}\nID: {qid}\nTYPE: {q.type}\nINSTRUCTION: ")
            texts.append(instruction_text(qid, q.instructions))
            texts.extend(render_option(oid, desc) for oid, desc in opts)
        tokenized: list[list[int]] = []
        fixed, start = base, 0
        while start < len(texts):
            end, size = start, 0
            while end < len(texts) and (end == start or size + len(texts[end]) <= SCHEMA_BATCH_CHARS):
                size += len(texts[end])
                end += 1
            check()
            batch = self._tokenize_cached(texts[start:end], self.segments)
            tokenized.extend(batch)
            fixed += sum(map(len, batch))
            start = end
            if fixed > max_length:
                raise _schema_too_long(fixed, max_length, exact=start == len(texts), media=len(media_ids))
        pieces = iter(tokenized)

        schema: list[int] = list(self._schema_header)
        layout = []  # (qid, type, question span, option ids, option spans), relative to the schema
        for (qid, q), opts in zip(questions, options):
            schema += next(pieces)
            instruction = next(pieces)
            q_span = (len(schema), len(schema) + len(instruction))
            schema += instruction
            schema += self._options_header
            spans = []
            for j in range(1, len(opts) + 1):
                schema += self._option_label(j)
                rendered = next(pieces)
                spans.append((len(schema), len(schema) + len(rendered)))
                schema += rendered
                schema += self._option_end
            schema += self._field_end
            layout.append((qid, q.type, q_span, tuple(o for o, _ in opts), spans))

        keep = max_length - fixed
        if self.max_state_tokens is not None:
            keep = min(keep, self.max_state_tokens)
        state, truncated, exact = self.state_ids(request.state, keep, check)

        offset = len(self._prefix) + len(media_ids) + len(state)
        media = self.media.inputs(request._media, counts, check) if media_ids else None
        fields = [
            EncodedField(qid, qtype, (offset + a, offset + b), oids, tuple((offset + c, offset + d) for c, d in spans))
            for qid, qtype, (a, b), oids, spans in layout
        ]
        ids = self._prefix + media_ids + state + schema + self._suffix
        return EncodedRequest(ids, fields, state_tokens=len(state), truncated_state_tokens=truncated,
                              schema_offset=offset, truncation_exact=exact, media=media, media_tokens=len(media_ids),
                              media_offset=len(self._prefix))

    def state_ids(self, state: Any, keep: int,
                  checkpoint: Callable[[], None] | None = None) -> tuple[list[int], int, bool]:
        """``(the first keep ids of the state's tokenization, how many ids were cut, exact?)``.

        Only a prefix of a long state is rendered and tokenized: one that ends at a safe cut and
        holds more than ``keep`` tokens, so its first ``keep`` ids are those of the whole state.
        The number cut is then estimated (``exact`` False) from the characters left out."""
        check = checkpoint or no_check
        text = StateText(state)
        keep = max(0, keep)
        if not self.split_state:                  # no provably safe cut for this tokenizer: all of it
            ids = self._tokenize_state(text.upto(1 << 62))
            return ids[:keep], max(0, len(ids) - keep), True
        need = keep + 1                           # one more than can be kept tells whether it is cut
        chars = max(STATE_PIECE_CHARS, need * PREFIX_CHARS_PER_TOKEN)
        while True:
            check()
            window = chars + STATE_PIECE_CHARS
            rendered = text.upto(window)
            whole = text.complete and len(rendered) <= window
            cut = None if whole else safe_cut(rendered, chars, window, added=self._added)
            if cut is None and not whole:         # no place to cut near: look further, within reason
                window = chars + MAX_UNCUT_CHARS
                rendered = text.upto(window + 1)
                whole = text.complete and len(rendered) <= window
                cut = None if whole else safe_cut(rendered, chars + STATE_PIECE_CHARS - 64, window, added=self._added)
                if cut is None and not whole:
                    raise RequestError(f"the state has a run of more than {MAX_UNCUT_CHARS} characters with no place "
                                       "where its tokenization can be cut (no space, digit or punctuation); split it",
                                       kind=Kind.TOO_COMPLEX, field="state")
            ids = self._tokenize_state(rendered if whole else rendered[:cut])
            if whole or len(ids) >= need:
                break
            chars = max(2 * chars, int(cut * need / max(1, len(ids)) * 1.25))
        if whole:
            return ids[:keep], max(0, len(ids) - keep), True
        check()
        rest = text.remaining_chars(cut)
        estimate = len(ids) - keep + round(rest * len(ids) / max(1, cut))
        return ids[:keep], estimate, False

    def _tokenize_state(self, text: str) -> list[int]:
        """The ids of a state text (or of a prefix of one). The list may be held for later requests about the
        same text (:data:`STATE_LIST_MIN_CHARS`): callers copy it, never change it."""
        held = len(text) >= STATE_LIST_MIN_CHARS
        if held and (ids := self.state_lists.get(text)) is not None:
            return ids
        pieces = state_pieces(text, added=self._added) if self.split_state and text else [text]
        if len(pieces) == 1:
            ids = self.tokenize(pieces[0])
        else:
            ids = list(chain.from_iterable(self._tokenize_cached(pieces, self.pieces)))
        if held:      # the text is held too, as the key: counted at ~40 characters an id
            self.state_lists.put(text, ids, len(ids) + len(text) // 40)
        return ids

    def _tokenize_cached(self, texts: Sequence[str], cache: PieceCache) -> list[Sequence[int]]:
        """Token ids of each of ``texts`` (segment-wise), from ``cache`` where it holds them; the rest are
        tokenized in one batch and kept."""
        keys = [PieceCache.key(t) for t in texts]
        found: list[Sequence[int] | None] = [cache.get(k) for k in keys]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            for i, ids in zip(missing, self._tokenize_many([texts[i] for i in missing])):
                found[i] = ids
                cache.put(keys[i], ids)
        return found


def _schema_too_long(tokens: int, max_length: int, exact: bool, media: int = 0) -> RequestError:
    need = f"{tokens}" if exact else f"at least {tokens}"
    if not media:
        return RequestError(f"schema requires {need} tokens before state; maximum is {max_length}",
                            kind=Kind.SCHEMA_TOO_LONG, field="questions")
    return RequestError(f"media ({media} tokens) and schema require {need} tokens before state; maximum is "
                        f"{max_length}", kind=Kind.SCHEMA_TOO_LONG, field="images")

