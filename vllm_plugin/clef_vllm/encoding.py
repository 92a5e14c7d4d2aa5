"""Record encoding: a validated SystemOne request -> token ids + question/option spans (docs/encoding-and-head.md).

The prompt is built by tokenizing fixed text segments ONE AT A TIME (``add_special_tokens=False``)
and concatenating the id lists, so BPE merges never cross a segment boundary and every span
boundary is a segment boundary. Tokenizing the whole prompt at once gives different ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain, islice
from pathlib import Path
from typing import Any, Sequence

from clef_vllm.protocol import TYPE_IDS, ChoiceQuestion, NoulQuestion, RequestError, SystemOneRequest

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
DEFAULT_MAX_LENGTH = 16384
#: Special tokens the fixed prompt text relies on; each must be ONE added token.
PROMPT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")

#: A state longer than 1.5 times this many characters is tokenized as pieces of about this size, in one
#: batched call (the Rust tokenizer encodes a batch on all cores; one long text uses one core).
#: The ids are exactly those of the whole state: see ``state_pieces``.
STATE_PIECE_CHARS = 4096
#: Qwen3.5's pre-tokenizer regex (tokenizer.json). It never puts a space that follows a
#: non-space character anywhere but at the START of a piece, and always ends a piece after a run
#: of newlines followed by a letter; BPE then runs on each piece alone. So cutting the text there
#: cannot change the ids (the ASCII character after the cut also keeps NFC from composing across it).
QWEN_PRETOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SAFE_CUT = re.compile(r"(?<=[!-~]) (?=[A-Za-z])|(?<=\n)(?=[A-Za-z])")


def state_pieces(text: str, size: int = STATE_PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, only before a space that follows a
    printable ASCII character and precedes an ASCII letter, or after a newline that precedes an
    ASCII letter; a text without such places stays whole."""
    pieces, start = [], 0
    while len(text) - start > size + size // 2:
        cut = _SAFE_CUT.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def render(value: Any) -> str:
    """A string verbatim; anything else as compact JSON with sorted keys and non-ASCII kept.

    Python's ``json`` prints floats with ``repr`` (``1250.0`` stays ``1250.0``), as the reference.
    """
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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
    cached_state_tokens: int = 0        # set by the backend: leading tokens read from the state cache
    _lexical_ids: list[int] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def lexical_ids(self) -> list[int]:
        """Token ids inside the option spans, in encoded option order (the lm_head rows the head reads)."""
        if self._lexical_ids is None:
            ids = self.input_ids
            self._lexical_ids = [t for f in self.fields for a, b in f.option_spans for t in ids[a:b]]
        return self._lexical_ids


class RequestEncoder:
    """Encodes validated requests with one tokenizer; constant segments are tokenized once."""

    def __init__(self, tokenizer, max_length: int = DEFAULT_MAX_LENGTH, max_state_tokens: int | None = None):
        # A transformers fast tokenizer or a bare ``tokenizers.Tokenizer``; we call the Rust
        # tokenizer directly (batched, no padding/truncation state, so it is thread-safe).
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
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
            added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
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
                and not any(c.isspace() for t in added for c in t))

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> "RequestEncoder":
        """Load the checkpoint's tokenizer (transformers AutoTokenizer, as the reference does)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), **kwargs)

    @property
    def prefix_ids(self) -> list[int]:
        return list(self._prefix)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one segment, no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def _tokenize_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, request: SystemOneRequest, max_length: int | None = None) -> EncodedRequest:
        """Token ids and absolute spans of ``request``; raises RequestError(413) if the schema alone is too long."""
        max_length = self.max_length if max_length is None else int(max_length)
        questions = list(request.questions.items())
        options = [question_options(q) for _, q in questions]

        # Every variable segment, tokenized in one batched call: the state (in pieces when it is
        # long, see state_pieces), then per field its header, its instruction and its option objects.
        state_text = render(request.state)
        texts = state_pieces(state_text) if self.split_state else [state_text]
        n_state = len(texts)
        for k, ((qid, q), opts) in enumerate(zip(questions, options), start=1):
            texts.append(f"\nFIELD {k}\nID: {qid}\nTYPE: {q.type}\nINSTRUCTION: ")
            texts.append(instruction_text(qid, q.instructions))
            texts.extend(render_option(oid, desc) for oid, desc in opts)
        pieces = iter(self._tokenize_many(texts))
        state = next(pieces) if n_state == 1 else list(chain.from_iterable(islice(pieces, n_state)))

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

        fixed = len(self._prefix) + len(schema) + len(self._suffix)
        if fixed > max_length:
            raise RequestError(f"schema requires {fixed} tokens before state; maximum is {max_length}",
                               field="questions", status=413)
        keep = max_length - fixed
        if self.max_state_tokens is not None:
            keep = min(keep, self.max_state_tokens)
        truncated = max(0, len(state) - keep)
        if truncated:
            state = state[:keep]

        offset = len(self._prefix) + len(state)
        fields = [
            EncodedField(qid, qtype, (offset + a, offset + b), oids, tuple((offset + c, offset + d) for c, d in spans))
            for qid, qtype, (a, b), oids, spans in layout
        ]
        ids = self._prefix + state + schema + self._suffix
        return EncodedRequest(ids, fields, state_tokens=len(state), truncated_state_tokens=truncated,
                              schema_offset=offset)
