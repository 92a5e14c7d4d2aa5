"""SystemOne wire protocol: request/response models, dialects, limits and client errors.

"Parse, don't validate": :func:`parse_systemone` turns a decoded JSON body into a typed
:class:`SystemOneRequest` or raises :class:`~clef_vllm.schema.errors.RequestError` naming the offending
field. The encoder only ever sees valid requests, and only requests within :class:`RequestLimits`:
structural limits, checked before any tokenization, that no request able to fit the token budget
can reach (so they cost nothing that the budget would not cost anyway).

Two dialects:

* ``reference`` (default) accepts what the release's Python code accepts, except two inputs it
  mishandles (an empty question id used as its own instruction, and noul criteria keys other
  than ``true``/``false``), which are refused instead of silently producing NaN or being ignored.
* ``workers-ai`` applies the hosted service's limits: 1-64 questions, 2-255 choice options,
  2-10 score levels, ids ``[A-Za-z0-9_.-]{1,100}``, required non-empty instructions, unknown
  fields refused; confidence is the normalised Gini purity and bodies use the hosted envelope.

A third, ``openai``, is not a SystemOne dialect but OpenAI's Decisions wire format
(``POST /v1/decisions``): :func:`clef_vllm.schema.dialects.parse_request` maps such a body to a SystemOne request through
:mod:`clef_vllm.schema.openai_decisions`, which also shapes its answers and errors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media import DEFAULT_MEDIA_LIMITS, WORKERS_AI_MEDIA_LIMITS, MediaLimits, parse_media

__all__ = ["Dialect", "SYSTEMONE_DIALECTS", "DialectRules", "RULES", "RequestLimits", "RequestError", "SystemOneRequest",
           "gini_purity", "parse_systemone",
           "question_field", "QUESTION_TYPES", "TYPE_IDS"]

QUESTION_TYPES = ("noul", "choice", "score")
#: Row of ``type_embedding`` per question type (docs/encoding-and-head.md).
TYPE_IDS = {"noul": 0, "choice": 1, "score": 2}


class Dialect(str, Enum):
    """Which acceptance rules, confidence formula and body envelope apply."""

    REFERENCE = "reference"
    WORKERS_AI = "workers-ai"
    OPENAI = "openai"          # OpenAI's Decisions wire format (clef_vllm.schema.openai_decisions)


#: The dialects of the SystemOne body itself (``--dialect``).
SYSTEMONE_DIALECTS = (Dialect.REFERENCE, Dialect.WORKERS_AI)


@dataclass(frozen=True)
class DialectRules:
    """Request limits of one dialect (``None`` means unlimited)."""

    max_questions: int | None = None
    min_options: int = 1
    max_options: int | None = None
    min_levels: int = 1
    max_levels: int | None = None
    question_id_pattern: re.Pattern | None = None
    require_instructions: bool = False
    forbid_unknown_fields: bool = False


RULES = {
    Dialect.REFERENCE: DialectRules(),
    Dialect.WORKERS_AI: DialectRules(
        max_questions=64,
        min_options=2,
        max_options=255,
        min_levels=2,
        max_levels=10,
        question_id_pattern=re.compile(r"[A-Za-z0-9_.\-]{1,100}"),
        require_instructions=True,
        forbid_unknown_fields=True,
    ),
}

# --------------------------------------------------------------------------- models


def _require_non_empty(message: str):
    """A pydantic field validator refusing empty containers with ``message``."""

    def check(cls, value):
        if not value:
            raise ValueError(message)
        return value

    return classmethod(check)


class _QuestionBase(BaseModel):
    # Extra keys are kept so the workers-ai dialect can refuse them; the reference ignores them.
    model_config = ConfigDict(extra="allow")

    instructions: Any = Field(
        default=None,
        description="Any JSON. A string is used verbatim, anything else as compact JSON. "
        "Missing, null or \"\" falls back to the question id (reference dialect).",
    )


class NoulQuestion(_QuestionBase):
    """A true/false question. Answer: P(true)."""

    type: Literal["noul"]
    criteria: dict[str, Any] | None = Field(
        default=None, description='Optional descriptions for "true" and/or "false" (null = no description).'
    )


class ChoiceQuestion(_QuestionBase):
    """Pick one option id. Options are encoded sorted by id; answers keep the request order."""

    type: Literal["choice"]
    criteria: dict[str, Any] = Field(description="option_id -> description (any JSON or null); not empty.")

    _not_empty = field_validator("criteria")(_require_non_empty("must not be empty"))


class ScoreQuestion(_QuestionBase):
    """An ordinal scale. Answer: the expected level index in [0, n-1]."""

    type: Literal["score"]
    criteria: list[Any] = Field(description="Level descriptions, lowest first; not empty.")

    _not_empty = field_validator("criteria")(_require_non_empty("must not be empty"))


Question = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    """``POST /v1/systemone`` body. ``questions`` keeps its wire order end to end."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="Echoed in the response.")
    state: Any = Field(description="Any JSON value (required key; may be null).")
    questions: dict[str, Question] = Field(description="Ordered map question_id -> question; at least one.")
    images: list[Any] | None = Field(default=None, description="data: URIs (base64 PNG, JPEG, WebP, GIF: first frame; "
                                     "workers-ai: PNG, JPEG, WebP, also bare base64), validated (docs/protocol.md, "
                                     "Media); this build's model does not see them yet (400 after validation).")
    videos: list[Any] | None = Field(default=None, description="Reference dialect: each an array of frames (data: URIs) "
                                     "or one animated GIF/WebP/PNG; validated, then 400 as images.")

    _at_least_one = field_validator("questions")(_require_non_empty("at least one question is required"))
    #: The OpenAI Decisions request this one was mapped from (``clef_vllm.schema.openai_decisions.DecisionPlan``).
    _decision: Any = PrivateAttr(default=None)
    #: Fields the reference dialect ignored, one line each (the response's ``warnings``).
    _warnings: list = PrivateAttr(default_factory=list)
    #: The validated media (``clef_vllm.schema.media.MediaItem``), images first; ``images``/``videos`` are then None.
    _media: list = PrivateAttr(default_factory=list)


class NoulAnswer(BaseModel):
    type: Literal["noul"] = "noul"
    noul: float


class ChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    choice: str
    confidence: float
    probabilities: dict[str, float]


class ScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    score: float
    confidence: float
    legend: dict[str, Any]
    probabilities: dict[str, float]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0
    truncated_state_tokens: int = Field(0, description="State tokens cut from the end to fit max_model_len.")
    cached_state_tokens: int = Field(0, description="Leading prompt tokens (system prompt and state) read from the "
                                     "state cache instead of computed.")


class SystemOneResponse(BaseModel):
    """Response body (reference dialect; workers-ai wraps it in ``{result, success, errors, messages}``)."""

    model: str
    answers: dict[str, Annotated[Union[NoulAnswer, ChoiceAnswer, ScoreAnswer], Field(discriminator="type")]]
    usage: Usage
    warnings: list[str] | None = Field(None, description="Only when the request had fields this dialect ignores "
                                       "(reference): one line each, e.g. \"questions.team.instuctions: unknown field, "
                                       "ignored\". The workers-ai dialect refuses them (422).")


# --------------------------------------------------------------------------- limits

#: The token budget the default limits are sized for (the release's max_length).
DEFAULT_MAX_TOKENS = 16384
#: Nesting levels allowed anywhere in a request (the body object is level 1). Deep enough for any
#: real document, shallow enough that no rendering or serialisation can run out of stack.
MAX_DEPTH = 128
#: Python refuses to convert longer integers to text (``sys.get_int_max_str_digits``).
MAX_INT_DIGITS = 4300
#: Characters of the ``model`` name (it is echoed in every answer).
MAX_MODEL_CHARS = 1000
#: Longest token of a byte-level BPE vocabulary that we assume when none is given (Qwen3.5: 128 bytes).
DEFAULT_MAX_TOKEN_BYTES = 128


@dataclass(frozen=True)
class RequestLimits:
    """Structural limits, checked while and right after parsing, before any tokenization.

    Each is sized from the token budget so that a request over it could never fit anyway:
    ``max_values`` JSON values (8 per token: the densest JSON, ``[[],[],...]`` or ``["","",...]``,
    takes more than one token per 8 values), ``max_questions`` (every question costs more than 16
    tokens of fixed text), ``max_options`` options and levels together (each costs more than 4),
    ``max_schema_chars`` characters of ids, instructions and descriptions together (no token holds
    more than ``max_token_bytes`` bytes). ``max_depth`` bounds the nesting of every field.
    ``None`` means unlimited."""

    max_values: int | None = None
    max_depth: int | None = MAX_DEPTH
    max_questions: int | None = None
    max_options: int | None = None
    max_schema_chars: int | None = None
    max_model_chars: int | None = MAX_MODEL_CHARS
    tokens: int | None = None                     # the budget they were sized for (for messages)
    media: MediaLimits = DEFAULT_MEDIA_LIMITS     # images and videos (the workers-ai dialect: the hosted limits)

    @classmethod
    def for_tokens(cls, max_tokens: int, max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES) -> "RequestLimits":
        """The limits for a token budget of ``max_tokens`` (``--max-model-len``)."""
        n = max(1, int(max_tokens))
        return cls(max_values=8 * n + 64, max_questions=n // 16 + 1, max_options=n // 4 + 2,
                   max_schema_chars=max(1, int(max_token_bytes)) * n, tokens=n)

    def budget(self) -> str:
        return f"{self.tokens} tokens (max_model_len)" if self.tokens else "the token budget"


DEFAULT_LIMITS = RequestLimits.for_tokens(DEFAULT_MAX_TOKENS)


# --------------------------------------------------------------------------- field paths

_PLAIN_ID = re.compile(r"[A-Za-z0-9_\-]+")


def question_field(qid: str, *rest: str) -> str:
    """The path of a question (or of one of its keys) in error messages: ``questions.team`` for a plain
    id (letters, digits, ``_``, ``-``), else the id JSON-quoted: ``questions[""]``, ``questions["a.b"]``."""
    head = f"questions.{qid}" if _PLAIN_ID.fullmatch(qid) else f"questions[{json.dumps(qid, ensure_ascii=False)}]"
    return ".".join((head, *rest))


def _loc_to_field(loc: tuple) -> str | None:
    parts = [str(p) for p in loc]
    # A discriminated union inserts the tag ("questions", qid, "choice", "criteria"): drop it.
    if len(parts) >= 3 and parts[0] == "questions" and parts[2] in QUESTION_TYPES:
        del parts[2]
    if len(parts) >= 2 and parts[0] == "questions":
        return question_field(parts[1], *parts[2:])
    return ".".join(parts) or None


# --------------------------------------------------------------------------- structure scan

_SURROGATE = re.compile("[\ud800-\udfff]")


def _key_error(key: Any, field: str | None) -> RequestError:
    """A key that is not a string (offline API): JSON objects have string keys only."""
    return RequestError(f"keys must be strings, got a key of type {type(key).__name__} ({str(key)[:40]})", field=field)


class _Scan:
    """One iterative pass over a decoded body: counts JSON values, bounds nesting, finds lone
    surrogates and non-JSON Python objects (offline API: keys that are not strings, 422; NaN and
    Infinity, 400, as the HTTP path's decoder), and sums the characters of the schema.
    Every subtree is walked with an explicit stack, so no input can exhaust the interpreter's."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits
        self.values = 0
        self.schema_chars = 0

    def walk(self, value: Any, field: str | None, *, depth: int = 1, check_text: bool = True,
             schema: bool = False) -> None:
        limits = self.limits
        max_values, max_depth = limits.max_values, limits.max_depth
        stack = [(value, depth)]
        while stack:
            node, level = stack.pop()
            self.values += 1
            if max_values is not None and self.values > max_values:
                raise RequestError(f"the request has more than {max_values} JSON values; no request with that many "
                                   f"fits in {limits.budget()}", kind=Kind.TOO_COMPLEX, field=field)
            if max_depth is not None and level > max_depth:
                raise RequestError(f"nested more than {max_depth} levels deep", kind=Kind.TOO_COMPLEX, field=field)
            if isinstance(node, str):
                self._text(node, field, check_text, schema)
            elif isinstance(node, dict):
                for key, item in node.items():
                    if not isinstance(key, str):
                        raise _key_error(key, field)
                    self._text(key, field, check_text, schema)
                    stack.append((item, level + 1))
            elif isinstance(node, (list, tuple)):
                stack.extend((item, level + 1) for item in node)
            elif isinstance(node, bool) or node is None:
                continue
            elif isinstance(node, float):
                if not math.isfinite(node):               # the HTTP path's decoder refuses these the same way
                    raise RequestError(f"{node!r} is not valid JSON (NaN and Infinity are not JSON numbers)",
                                       kind=Kind.MALFORMED, field=field)
            elif isinstance(node, int):
                if node.bit_length() > 14_000:            # up to 14,000 bits always has fewer than 4,300 digits
                    try:
                        str(node)
                    except ValueError:
                        raise RequestError(f"an integer has more than {MAX_INT_DIGITS} digits", field=field) from None
            else:
                raise RequestError(f"is not JSON-serialisable (a {type(node).__name__})", field=field)

    def _text(self, text: str, field: str | None, check_text: bool, schema: bool) -> None:
        if check_text and not text.isascii() and _SURROGATE.search(text):
            raise RequestError("contains an unpaired UTF-16 surrogate", field=field)
        if schema:
            self.schema_chars += len(text)


# --------------------------------------------------------------------------- parsing

_MESSAGES = {
    "missing": "is required",
    "union_tag_invalid": "type must be noul, choice, or score",
    "union_tag_not_found": "type must be noul, choice, or score",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "list_type": "must be an array",
    "string_type": "must be a string",
}


def _from_validation_error(err: ValidationError) -> RequestError:
    first = err.errors(include_url=False)[0]
    field = _loc_to_field(first["loc"])
    if first["type"] in ("value_error", "assertion_error"):
        message = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
    else:
        message = _MESSAGES.get(first["type"], first["msg"])
    if field is None and first["type"] in ("model_type", "model_attributes_type"):
        message = "request body must be a JSON object"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found") and field:
        field += ".type"
    return RequestError(message, field=field)


def _instructions_missing(value: Any) -> bool:
    return value is None or value == "" and isinstance(value, str)


def _scan_body(body: dict, limits: RequestLimits) -> _Scan:
    """Walk every part of the body before validating it (counts, nesting, text, JSON types)."""
    scan = _Scan(limits)
    scan.values += 1                                            # the body object itself
    for key, value in body.items():
        if not isinstance(key, str):
            raise _key_error(key, None)
        if key == "questions" and isinstance(value, dict):
            scan.values += 1
            for qid, question in value.items():
                if not isinstance(qid, str):
                    raise _key_error(qid, "questions")
                where = question_field(qid)
                scan._text(qid, where, True, True)
                if isinstance(question, dict):
                    scan.values += 1
                    for qkey, item in question.items():
                        used = qkey in ("instructions", "criteria", "type")
                        scan.walk(item, question_field(qid, qkey) if used else where, depth=4, check_text=used,
                                  schema=used and qkey != "type")
                else:
                    scan.walk(question, where, depth=3)
        else:
            scan.walk(value, key, depth=2, check_text=key in ("model", "state"))
    return scan


def gini_purity(probs: Sequence[float]) -> float:
    """Hosted confidence: ``(n·Σp² − 1)/(n − 1)`` clipped to [0, 1] (from the 4-decimal probabilities)."""
    n = len(probs)
    if n < 2:
        return 1.0
    return min(1.0, max(0.0, (n * sum(p * p for p in probs) - 1.0) / (n - 1)))


def parse_systemone(body: Any, dialect: Dialect | str = Dialect.REFERENCE,
                    limits: RequestLimits | None = DEFAULT_LIMITS) -> SystemOneRequest:
    """Validate a decoded JSON body of a SystemOne dialect into a :class:`SystemOneRequest` or raise
    :class:`RequestError` (:func:`clef_vllm.schema.dialects.parse_request` parses every dialect).

    ``limits`` (default: sized for 16,384 tokens; ``None``: none) are checked first, on the raw
    structure, then the request is validated field by field."""
    dialect = Dialect(dialect)
    if dialect is Dialect.OPENAI:
        raise ValueError(f"{dialect.value} is not a SystemOne dialect: clef_vllm.schema.dialects.parse_request parses it")
    rules = RULES[dialect]
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    limits = limits or RequestLimits(max_depth=None, max_model_chars=None)
    scan = _scan_body(body, limits)
    questions = body.get("questions")
    if limits.max_questions is not None and isinstance(questions, dict) and len(questions) > limits.max_questions:
        raise RequestError(f"at most {limits.max_questions} questions fit in {limits.budget()}, got {len(questions)}",
                           kind=Kind.TOO_COMPLEX, field="questions")
    try:
        req = SystemOneRequest.model_validate(body)
    except ValidationError as err:
        raise _from_validation_error(err) from None

    if rules.forbid_unknown_fields and req.model_extra:
        raise RequestError("unknown field", field=next(iter(req.model_extra)))
    if rules.max_questions is not None and len(req.questions) > rules.max_questions:
        raise RequestError(f"at most {rules.max_questions} questions are allowed, got {len(req.questions)}",
                           field="questions")
    if limits.max_model_chars is not None and len(req.model) > limits.max_model_chars:
        raise RequestError(f"at most {limits.max_model_chars} characters are allowed, got {len(req.model)}",
                           kind=Kind.TOO_COMPLEX, field="model")

    options = 0
    for qid, q in req.questions.items():
        if rules.question_id_pattern is not None and not rules.question_id_pattern.fullmatch(qid):
            raise RequestError("question id must match [A-Za-z0-9_.-]{1,100}", field=question_field(qid))
        if rules.forbid_unknown_fields and q.model_extra:
            raise RequestError("unknown field", field=question_field(qid, next(iter(q.model_extra))))
        if _instructions_missing(q.instructions):
            if rules.require_instructions:
                raise RequestError("instructions are required and must not be empty",
                                   field=question_field(qid, "instructions"))
            if qid == "":
                raise RequestError("an empty question id needs non-empty instructions",
                                   field=question_field(qid, "instructions"))
        if isinstance(q, NoulQuestion):
            unknown = sorted(set(q.criteria or {}) - {"true", "false"})
            if unknown:
                raise RequestError(f"noul criteria keys must be \"true\" or \"false\", got {unknown[0]!r}",
                                   field=question_field(qid, "criteria"))
            options += 2
        elif isinstance(q, ChoiceQuestion):
            _check_count(len(q.criteria), rules.min_options, rules.max_options, "options",
                         question_field(qid, "criteria"))
            options += len(q.criteria)
        else:
            _check_count(len(q.criteria), rules.min_levels, rules.max_levels, "levels",
                         question_field(qid, "criteria"))
            options += len(q.criteria)
    if limits.max_options is not None and options > limits.max_options:
        raise RequestError(f"at most {limits.max_options} options and levels (all questions together) fit in "
                           f"{limits.budget()}, got {options}", kind=Kind.TOO_COMPLEX, field="questions")
    if limits.max_schema_chars is not None and scan.schema_chars > limits.max_schema_chars:
        raise RequestError(f"question ids, instructions and criteria have {scan.schema_chars} characters; at most "
                           f"{limits.max_schema_chars} fit in {limits.budget()}", kind=Kind.TOO_COMPLEX,
                           field="questions")
    if not rules.forbid_unknown_fields:
        req._warnings = unknown_fields(req)
    attach_media(req, req.images, req.videos, dialect, limits)
    return req


def attach_media(req: SystemOneRequest, images: Any, videos: Any, dialect: Dialect, limits: RequestLimits | None,
                 *, local: bool = False) -> None:
    """Validate ``images`` and ``videos`` (bytes and headers: :func:`clef_vllm.schema.media.parse_media`) into
    ``req._media``, after everything else in the request passed; the request then holds no base64 text.
    ``local``: the offline API (bytes, paths and ``PIL.Image`` objects too)."""
    media = WORKERS_AI_MEDIA_LIMITS if dialect is Dialect.WORKERS_AI else (limits or DEFAULT_LIMITS).media
    req._media = parse_media(images, videos, media, local=local)
    req.images = req.videos = None


def unknown_fields(req: SystemOneRequest) -> list[str]:
    """One line per field of ``req`` that no rule reads (a misspelt ``instuctions``, say): the reference
    dialect answers without them and says so in the response's ``warnings``."""
    out = [f"{key}: unknown field, ignored" for key in req.model_extra or ()]
    for qid, q in req.questions.items():
        out += [f"{question_field(qid, key)}: unknown field, ignored" for key in q.model_extra or ()]
    return out


def _check_count(n: int, lo: int, hi: int | None, what: str, field: str) -> None:
    if n < lo or (hi is not None and n > hi):
        bound = f"{lo}-{hi}" if hi is not None else f"at least {lo}"
        raise RequestError(f"{bound} {what} are allowed, got {n}", field=field)
