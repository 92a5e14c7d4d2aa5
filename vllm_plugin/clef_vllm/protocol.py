"""SystemOne wire protocol: request/response models, dialects, limits and client errors.

"Parse, don't validate": :func:`parse_request` turns a decoded JSON body into a typed
:class:`SystemOneRequest` or raises :class:`RequestError` naming the offending field. The
encoder only ever sees valid requests.

Two dialects:

* ``reference`` (default) accepts what the release's Python code accepts, except two inputs it
  mishandles (an empty question id used as its own instruction, and noul criteria keys other
  than ``true``/``false``), which are refused instead of silently producing NaN or being ignored.
* ``workers-ai`` applies the hosted service's limits: 1-64 questions, 2-255 choice options,
  2-10 score levels, ids ``[A-Za-z0-9_.-]{1,100}``, required non-empty instructions, unknown
  fields refused; confidence is the normalised Gini purity and bodies use the hosted envelope.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

QUESTION_TYPES = ("noul", "choice", "score")
#: Row of ``type_embedding`` per question type (docs/encoding-and-head.md).
TYPE_IDS = {"noul": 0, "choice": 1, "score": 2}


class Dialect(str, Enum):
    """Which acceptance rules, confidence formula and body envelope apply."""

    REFERENCE = "reference"
    WORKERS_AI = "workers-ai"


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

# Error codes of the hosted service's envelope, by HTTP status.
HOSTED_ERROR_CODES = {400: 6003, 401: 10000, 404: 7000, 413: 5021, 422: 5012, 429: 3040, 503: 3040}


class RequestError(ValueError):
    """A client mistake. ``status`` is the HTTP status, ``field`` a dotted path into the body."""

    #: The hosted envelope's code when it is not the one of ``status`` in ``HOSTED_ERROR_CODES``.
    hosted_code: int | None = None

    def __init__(self, message: str, *, field: str | None = None, status: int = 422):
        # Field paths and messages can quote client strings; escape lone surrogates so the
        # error body itself is always encodable as UTF-8.
        message, field = _printable(message), None if field is None else _printable(field)
        super().__init__(f"{field}: {message}" if field else message)
        self.message = message
        self.field = field
        self.status = status

    def body(self, dialect: Dialect | str = Dialect.REFERENCE) -> dict:
        """The JSON error body in the dialect's envelope."""
        if Dialect(dialect) is Dialect.WORKERS_AI:
            code = self.hosted_code or HOSTED_ERROR_CODES.get(self.status, 5012)
            return {"success": False, "errors": [{"code": code, "message": str(self)}], "messages": [], "result": None}
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.field, "code": self.status}}


def _printable(text: str) -> str:
    """``text`` with unpaired UTF-16 surrogates written as ``\\udXXX`` escapes (valid UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    images: list[Any] | None = Field(default=None, description="Not supported by this build (HTTP 400 if non-empty).")
    videos: list[Any] | None = Field(default=None, description="Not supported by this build (HTTP 400 if non-empty).")

    _at_least_one = field_validator("questions")(_require_non_empty("at least one question is required"))


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


def _loc_to_field(loc: tuple) -> str:
    parts = [str(p) for p in loc]
    # A discriminated union inserts the tag ("questions", qid, "choice", "criteria"): drop it.
    if len(parts) >= 3 and parts[0] == "questions" and parts[2] in QUESTION_TYPES:
        del parts[2]
    return ".".join(parts)


def _from_validation_error(err: ValidationError) -> RequestError:
    first = err.errors(include_url=False)[0]
    field = _loc_to_field(first["loc"]) or None
    if first["type"] in ("value_error", "assertion_error"):
        message = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
    else:
        message = _MESSAGES.get(first["type"], first["msg"])
    if field is None and first["type"] in ("model_type", "model_attributes_type"):
        message = "request body must be a JSON object"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found") and field:
        field += ".type"
    return RequestError(message, field=field)


def _require_utf8(value: Any, field: str) -> None:
    """Refuse strings the tokenizer cannot encode (lone surrogates from ``\\ud800`` escapes)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("contains an unpaired UTF-16 surrogate", field=field) from None
    except (TypeError, ValueError) as exc:  # offline API: a Python object that is not JSON
        raise RequestError(f"is not JSON-serialisable ({exc})", field=field) from None


def _instructions_missing(value: Any) -> bool:
    return value is None or value == "" and isinstance(value, str)


def parse_request(body: Any, dialect: Dialect | str = Dialect.REFERENCE) -> SystemOneRequest:
    """Validate a decoded JSON body into a :class:`SystemOneRequest` or raise :class:`RequestError`."""
    dialect = Dialect(dialect)
    rules = RULES[dialect]
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    try:
        req = SystemOneRequest.model_validate(body)
    except ValidationError as err:
        raise _from_validation_error(err) from None

    for media in ("images", "videos"):
        if getattr(req, media):
            raise RequestError("not supported by this build (text-only)", field=media, status=400)
    if rules.forbid_unknown_fields and req.model_extra:
        raise RequestError("unknown field", field=next(iter(req.model_extra)))
    if rules.max_questions is not None and len(req.questions) > rules.max_questions:
        raise RequestError(f"at most {rules.max_questions} questions are allowed, got {len(req.questions)}",
                           field="questions")
    _require_utf8(req.model, "model")
    _require_utf8(req.state, "state")

    for qid, q in req.questions.items():
        where = f"questions.{qid}"
        _require_utf8(qid, where)
        if rules.question_id_pattern is not None and not rules.question_id_pattern.fullmatch(qid):
            raise RequestError("question id must match [A-Za-z0-9_.-]{1,100}", field=where)
        if rules.forbid_unknown_fields and q.model_extra:
            raise RequestError("unknown field", field=f"{where}.{next(iter(q.model_extra))}")
        if _instructions_missing(q.instructions):
            if rules.require_instructions:
                raise RequestError("instructions are required and must not be empty", field=f"{where}.instructions")
            if qid == "":
                raise RequestError("an empty question id needs non-empty instructions", field=f"{where}.instructions")
        else:
            _require_utf8(q.instructions, f"{where}.instructions")
        if q.criteria is not None:
            _require_utf8(q.criteria, f"{where}.criteria")
        if isinstance(q, NoulQuestion):
            unknown = sorted(set(q.criteria or {}) - {"true", "false"})
            if unknown:
                raise RequestError(f"noul criteria keys must be \"true\" or \"false\", got {unknown[0]!r}",
                                   field=f"{where}.criteria")
        elif isinstance(q, ChoiceQuestion):
            _check_count(len(q.criteria), rules.min_options, rules.max_options, "options", f"{where}.criteria")
        else:
            _check_count(len(q.criteria), rules.min_levels, rules.max_levels, "levels", f"{where}.criteria")
    return req


def _check_count(n: int, lo: int, hi: int | None, what: str, field: str) -> None:
    if n < lo or (hi is not None and n > hi):
        bound = f"{lo}-{hi}" if hi is not None else f"at least {lo}"
        raise RequestError(f"{bound} {what} are allowed, got {n}", field=field)
