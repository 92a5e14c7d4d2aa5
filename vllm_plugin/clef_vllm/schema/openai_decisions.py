"""OpenAI's Decisions wire format (``POST /v1/decisions``) mapped onto SystemOne, both ways.

The one home of the mapping: the HTTP route, its bulk variant and the offline API
(``Clef.decisions``) all call :func:`parse_decision_request` and :func:`decision_response`.
A Decisions request becomes a SystemOne request (validated and limited by
:func:`~clef_vllm.schema.protocol.parse_systemone`, reference rules), is encoded and decided exactly as
``POST /v1/systemone`` decides it, and its SystemOne answers become Decisions answers, so the
probabilities are the very numbers ``/v1/systemone`` returns for the same decision.

Request mapping (docs/operating.md, "The OpenAI Decisions route"):

* ``input`` as a string is the state. As items: when every item is a user message, the state is
  the content of the messages (texts joined with a newline; an ``input_json`` part is its JSON
  value; one part alone is that part; texts mixed with JSON values make a JSON array). Any other
  item (system, developer and assistant messages, tool calls and their outputs) makes the state a
  JSON array mirroring the items: ``{"role", "content"}`` per message, ``{"type", "call_id",
  "name", "arguments"}`` per call, ``{"type", "call_id", "output"}`` per output. An output must
  follow a call with its ``call_id``.
* a question's ``name`` is its SystemOne id (unnamed questions get ``question_<i>``, ``i`` its
  0-based position, with ``_`` appended until it is unused); names are unique.
* ``predicate`` -> ``noul``; ``choice`` -> ``choice`` with criteria ``{value: description}``
  (a boolean value is the id ``"true"``/``"false"``; a string and a boolean with the same text
  are both distinct values in OpenAI's schema but one id in Clef's, so they are refused);
  ``score`` -> ``score`` with one criterion per level: ``label``, or ``"label: description"``.
* ``instructions`` as parts: texts joined with a newline; one ``input_json`` part alone is its value.
* ``input_image`` in ``input`` (a user message or a tool call's output): its ``image_url`` (a ``data:`` URI; URLs are
  not fetched) becomes the next SystemOne ``images`` entry and the part the text ``[image N]`` (1-based) in the
  state, so the model reads where each image was; ``detail`` may be ``auto`` (or left out). Clef puts the images
  before the state; an ``input_image`` in a question's ``instructions`` has no such place and is refused with 400
  naming the part. Media errors name the part too (``input[0].content[1]``). ``prompt_cache_key``, ``prompt_cache_options``, ``safety_identifier`` and
  ``prompt_cache_breakpoint`` are accepted (type-checked) and have no effect.

Response mapping: ``predicate`` -> ``probability`` (the SystemOne ``noul``); ``choice`` ->
the typed value, ``probabilities`` ``[{value, probability}]`` in request order; ``score`` ->
the SystemOne score, ``probabilities`` ``[{value, label, probability}]``. ``confidence`` is the
normalised Gini purity ``(n·Σp² − 1)/(n − 1)`` of the returned (4-decimal) probabilities, in
[0, 1] (the hosted model's formula); ``name`` is always present (``null`` for an unnamed
question). ``usage`` is integers: ``input_tokens``, ``input_tokens_details.cached_tokens``
(tokens read from the state cache), ``output_tokens`` 0, ``total_tokens``.

Over-length: a request whose input does not fit ``--max-model-len`` is refused with 400
``context_length_exceeded`` (param ``input``) instead of having its state cut: the Decisions
response has no field that could say an answer was made on a cut input (:func:`check_fits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.protocol import (DEFAULT_LIMITS, Dialect, RequestLimits, SystemOneRequest, gini_purity,
                                       parse_systemone, question_field)

__all__ = ["DecisionPlan", "parse_decision_request", "decision_response", "check_fits", "MAX_QUESTIONS",
           "MAX_CHOICES"]

#: OpenAI's documented bounds: 1-400 questions, 2-255 choices per question.
MAX_QUESTIONS = 400
MAX_CHOICES = 255
MIN_LEVELS = 2
#: ``safety_identifier``'s length limit (Responses' limit).
MAX_SAFETY_IDENTIFIER = 128

_REQUEST_KEYS = {"model", "input", "questions", "prompt_cache_key", "prompt_cache_options", "safety_identifier"}
_QUESTION_KEYS = {"predicate": {"type", "name", "instructions"},
                  "choice": {"type", "name", "instructions", "choices"},
                  "score": {"type", "name", "instructions", "levels"}}
_CLEF_TYPES = {"predicate": "noul", "choice": "choice", "score": "score"}
_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}
_ROLES = ("user", "system", "developer", "assistant")


@dataclass
class _Question:
    name: str | None            # as sent (None: unnamed)
    qid: str                    # the SystemOne question id
    type: str                   # predicate | choice | score
    values: dict[str, Any] = field(default_factory=dict)   # choice: SystemOne option id -> typed value
    labels: list[str] = field(default_factory=list)         # score: level labels


@dataclass
class DecisionPlan:
    """A Decisions request as SystemOne: ``request`` (validated) and what the answers need back."""

    request: SystemOneRequest
    questions: list[_Question]


# --------------------------------------------------------------------------- request


def _err(message: str, path: str | None, kind: Kind = Kind.INVALID) -> RequestError:
    return RequestError(message, kind=kind, field=path)


def _obj(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise _err("must be an object", path)
    return value


def _text(value: Any, path: str, *, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise _err("must be a string", path)
    if not empty and not value.strip():
        raise _err("must not be empty", path)
    return value


def _known(obj: dict, allowed: set[str], path: str | None) -> None:
    for key in obj:
        if key not in allowed:
            raise _err(f"unknown parameter {key!r}", f"{path}.{key}" if path else key)


def _required(obj: dict, key: str, path: str | None) -> Any:
    if key not in obj:
        raise _err("is required", f"{path}.{key}" if path else key)
    return obj[key]


def _part_value(part: Any, path: str, allowed: tuple[str, ...], images: list | None = None) -> Any:
    """An input part's value in the state: ``input_text``/``output_text`` -> its text, ``input_json``
    -> its data, ``refusal`` -> ``{"type": "refusal", "refusal": ...}``, ``input_image`` -> ``[image N]``
    (its ``(image_url, path)`` appended to ``images``; ``None``: where images have no place)."""
    part = _obj(part, path)
    kind = part.get("type")
    if kind not in allowed:
        raise _err(f"type must be one of {', '.join(allowed)}", f"{path}.type")
    if kind == "input_image":
        if images is None:
            raise _err("input_image has no place in a question's instructions: the model sees images next to the "
                       "input only; put it in the input", path, Kind.UNSUPPORTED)
        _known(part, {"type", "image_url", "detail", "prompt_cache_breakpoint"}, path)
        _cache_breakpoint(part, path)
        if part.get("detail") not in (None, "auto"):
            raise _err("only detail 'auto' is served (the checkpoint's processor sizes every image)",
                       f"{path}.detail", Kind.UNSUPPORTED)
        images.append((_text(_required(part, "image_url", path), f"{path}.image_url", empty=False), path))
        return f"[image {len(images)}]"
    if kind in ("input_text", "output_text"):
        _known(part, {"type", "text", "prompt_cache_breakpoint", "annotations", "logprobs"}, path)
        _cache_breakpoint(part, path)
        return _text(_required(part, "text", path), f"{path}.text")
    if kind == "input_json":
        _known(part, {"type", "data", "prompt_cache_breakpoint"}, path)
        _cache_breakpoint(part, path)
        data = _required(part, "data", path)
        if not isinstance(data, (dict, list)):
            raise _err("must be an object or an array of objects", f"{path}.data")
        return data
    _known(part, {"type", "refusal"}, path)
    return {"type": "refusal", "refusal": _text(_required(part, "refusal", path), f"{path}.refusal")}


def _cache_breakpoint(part: dict, path: str) -> None:
    mark = part.get("prompt_cache_breakpoint")
    if mark is not None and not isinstance(mark, dict):
        raise _err("must be an object", f"{path}.prompt_cache_breakpoint")


def _join(values: list[Any]) -> Any:
    """Parts as one state value: one part alone as it is; texts joined with a newline; else the list."""
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, str) for v in values):
        return "\n".join(values)
    return values


def _content(content: Any, path: str, allowed: tuple[str, ...], images: list) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _err("must be a string or a non-empty array of parts", path)
    return _join([_part_value(p, f"{path}[{i}]", allowed, images) for i, p in enumerate(content)])


_PARTS = {"user": ("input_text", "input_image", "input_json"), "system": ("input_text",),
          "developer": ("input_text",), "assistant": ("output_text", "refusal")}


def _render_input(value: Any, images: list) -> Any:
    """The state of a Decisions ``input`` (see the module's docstring); its images are appended to ``images``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _err("must be a string or a non-empty array of input items", "input")
    rendered, user_only, calls = [], True, set()
    for i, item in enumerate(value):
        path = f"input[{i}]"
        item = _obj(item, path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _required(item, "role", path)
            if role not in _ROLES:
                raise _err(f"role must be one of {', '.join(_ROLES)}", f"{path}.role")
            _known(item, {"type", "role", "content", "phase", "id", "status"}, path)
            content = _content(_required(item, "content", path), f"{path}.content", _PARTS[role], images)
            user_only &= role == "user"
            rendered.append({"role": role, "content": content})
        elif kind in _CALLS:
            arg = "arguments" if kind == "function_call" else "input"
            _known(item, {"type", "call_id", "name", arg, "id", "namespace", "status"}, path)
            call_id = _text(_required(item, "call_id", path), f"{path}.call_id")
            out = {"type": kind, "call_id": call_id, "name": _text(_required(item, "name", path), f"{path}.name"),
                   arg: _text(_required(item, arg, path), f"{path}.{arg}")}
            if item.get("namespace") is not None:
                out["namespace"] = _text(item["namespace"], f"{path}.namespace")
            calls.add((kind, call_id))
            user_only = False
            rendered.append(out)
        elif kind in _OUTPUTS:
            _known(item, {"type", "call_id", "output", "id", "status"}, path)
            call_id = _text(_required(item, "call_id", path), f"{path}.call_id")
            if (_OUTPUTS[kind], call_id) not in calls:
                raise _err(f"no earlier {_OUTPUTS[kind]} has call_id {call_id!r}", f"{path}.call_id")
            output = _content(_required(item, "output", path), f"{path}.output", ("input_text", "input_image"),
                              images)
            user_only = False
            rendered.append({"type": kind, "call_id": call_id, "output": output})
        else:
            raise _err("type must be message, function_call, function_call_output, custom_tool_call or "
                       "custom_tool_call_output", f"{path}.type")
    if user_only:
        return _join([m["content"] for m in rendered])
    return rendered


def _instructions(value: Any, path: str) -> Any:
    if isinstance(value, str):
        return _text(value, path, empty=False)
    if not isinstance(value, list) or not value:
        raise _err("must be a non-empty string or array of parts", path)
    return _join([_part_value(p, f"{path}[{i}]", ("input_text", "input_image", "input_json"))
                  for i, p in enumerate(value)])


def _choices(value: Any, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(criteria, option id -> typed value)`` of a choice question."""
    if not isinstance(value, list):
        raise _err("must be an array", path)
    if not 2 <= len(value) <= MAX_CHOICES:
        raise _err(f"2-{MAX_CHOICES} choices are allowed, got {len(value)}", path)
    criteria, values = {}, {}
    for j, choice in enumerate(value):
        where = f"{path}[{j}]"
        choice = _obj(choice, where)
        _known(choice, {"value", "description"}, where)
        typed = _required(choice, "value", where)
        if isinstance(typed, bool):
            option = "true" if typed else "false"
        elif isinstance(typed, str):
            option = typed
        else:
            raise _err("must be a string or a boolean", f"{where}.value")
        if option in values:
            same = values[option] == typed and type(values[option]) is type(typed)
            raise _err("duplicate choice value" if same else
                       f"{json.dumps(typed)} and {json.dumps(values[option])} are the same option for this model",
                       f"{where}.value")
        description = choice.get("description")
        if description is not None:
            _text(description, f"{where}.description")
        criteria[option], values[option] = description, typed
    return criteria, values


def _levels(value: Any, path: str) -> tuple[list[str], list[str]]:
    """``(criteria, labels)`` of a score question."""
    if not isinstance(value, list):
        raise _err("must be an array", path)
    if len(value) < MIN_LEVELS:
        raise _err(f"at least {MIN_LEVELS} levels are required, got {len(value)}", path)
    criteria, labels = [], []
    for j, level in enumerate(value):
        where = f"{path}[{j}]"
        level = _obj(level, where)
        _known(level, {"label", "description"}, where)
        label = _text(_required(level, "label", where), f"{where}.label", empty=False)
        description = level.get("description")
        if description is not None:
            _text(description, f"{where}.description")
        criteria.append(f"{label}: {description}" if description else label)
        labels.append(label)
    return criteria, labels


def _optional_text(body: dict, key: str, limit: int | None = None) -> None:
    value = body.get(key)
    if value is None:
        return
    _text(value, key)
    if limit is not None and len(value) > limit:
        raise _err(f"at most {limit} characters are allowed, got {len(value)}", key)


def parse_decision_request(body: Any, limits: RequestLimits | None = DEFAULT_LIMITS) -> DecisionPlan:
    """Validate a decoded Decisions body and map it to a SystemOne request, or raise
    :class:`~clef_vllm.schema.errors.RequestError` whose ``field`` is the JSON path in the Decisions body
    (``questions[2].levels``). The SystemOne request then passes the reference rules and ``limits``."""
    if not isinstance(body, dict):
        raise _err("request body must be a JSON object", None)
    _known(body, _REQUEST_KEYS, None)
    model = _text(_required(body, "model", None), "model", empty=False)
    _optional_text(body, "prompt_cache_key")
    _optional_text(body, "safety_identifier", MAX_SAFETY_IDENTIFIER)
    options = body.get("prompt_cache_options")
    if options is not None:
        _known(_obj(options, "prompt_cache_options"), {"mode", "ttl"}, "prompt_cache_options")
    images: list[tuple[str, str]] = []           # (image_url, the part's path)
    state = _render_input(_required(body, "input", None), images)
    raw = _required(body, "questions", None)
    if not isinstance(raw, list):
        raise _err("must be an array", "questions")
    if not 1 <= len(raw) <= MAX_QUESTIONS:
        raise _err(f"1-{MAX_QUESTIONS} questions are allowed, got {len(raw)}", "questions")

    names: dict[str, int] = {}
    for i, q in enumerate(raw):
        name = q.get("name") if isinstance(q, dict) else None
        if name is None:
            continue
        _text(name, f"questions[{i}].name", empty=False)
        if name in names:
            raise _err(f"duplicate question name (questions[{names[name]}] has it)", f"questions[{i}].name")
        names[name] = i

    questions, systemone = [], {}
    for i, q in enumerate(raw):
        path = f"questions[{i}]"
        q = _obj(q, path)
        kind = q.get("type")
        if kind not in _QUESTION_KEYS:
            raise _err("type must be predicate, choice or score", f"{path}.type")
        _known(q, _QUESTION_KEYS[kind], path)
        name = q.get("name")
        qid = name if name is not None else _synthetic_id(i, names)
        entry = {"type": _CLEF_TYPES[kind], "instructions": _instructions(_required(q, "instructions", path),
                                                                          f"{path}.instructions")}
        question = _Question(name, qid, kind)
        if kind == "choice":
            entry["criteria"], question.values = _choices(_required(q, "choices", path), f"{path}.choices")
        elif kind == "score":
            entry["criteria"], question.labels = _levels(_required(q, "levels", path), f"{path}.levels")
        systemone[qid] = entry
        questions.append(question)

    mapped = {"model": model, "state": state, "questions": systemone} | ({"images": [u for u, _ in images]} if images
                                                                        else {})
    try:
        request = parse_systemone(mapped, Dialect.REFERENCE, limits)
    except RequestError as exc:
        raise RequestError(exc.message, kind=exc.kind, field=_field_path(exc.field, questions, images)) from None
    return DecisionPlan(request, questions)


def _synthetic_id(i: int, names: dict[str, int]) -> str:
    qid = f"question_{i}"
    while qid in names:
        qid += "_"
    names[qid] = i
    return qid


def _field_path(path: str | None, questions: list[_Question], images: list = ()) -> str | None:
    """A SystemOne field path as the Decisions request's JSON path (``state`` -> ``input``,
    ``questions.team.criteria`` -> ``questions[1].choices``, ``images[1]`` -> its part, ``input[0].content[3]``)."""
    if path is None:
        return None
    if path.startswith("images"):
        index = path[len("images["):].split("]", 1)[0]
        return images[int(index)][1] if index.isdigit() and int(index) < len(images) else "input"
    if path == "state" or path.startswith("state."):
        return "input" + path[5:]
    if not path.startswith("questions"):
        return path
    for i, q in enumerate(questions):
        head = question_field(q.qid)
        if path == head or path.startswith(head + "."):
            rest = path[len(head):]
            if rest.startswith(".criteria"):
                rest = (".choices" if q.type == "choice" else ".levels") + rest[len(".criteria"):]
            return f"questions[{i}]{rest}"
    return path


# --------------------------------------------------------------------------- response


def check_fits(encoded) -> None:
    """Refuse (400 ``context_length_exceeded``) an encoded request whose state had to be cut."""
    cut = encoded.truncated_state_tokens
    if cut:
        about = "" if encoded.truncation_exact else "about "
        # "Input tokens exceed the configured limit" is one of the phrases LangChain maps to its
        # context-overflow error (the SDK's exception text carries the message, not the code).
        raise RequestError(f"Input tokens exceed the configured limit of {encoded.num_tokens} tokens (max_model_len): "
                           f"the request needs {about}{encoded.num_tokens + cut}, the input is {about}{cut} too many; "
                           "this route does not cut the input", kind=Kind.TOO_MANY_TOKENS, field="input")


def decision_response(plan: DecisionPlan, systemone: dict) -> dict:
    """The Decisions response body from the SystemOne response (reference dialect) of ``plan.request``."""
    answers = []
    for q in plan.questions:
        a = systemone["answers"][q.qid]
        if q.type == "predicate":
            answers.append({"type": "predicate", "name": q.name, "probability": a["noul"]})
        elif q.type == "choice":
            probs = a["probabilities"]
            answers.append({"type": "choice", "name": q.name, "choice": q.values[a["choice"]],
                            "confidence": round(gini_purity(list(probs.values())), 4),
                            "probabilities": [{"value": q.values[k], "probability": p} for k, p in probs.items()]})
        else:
            probs = list(a["probabilities"].values())
            answers.append({"type": "score", "name": q.name, "score": a["score"],
                            "confidence": round(gini_purity(probs), 4),
                            "probabilities": [{"value": i, "label": label, "probability": p}
                                              for i, (label, p) in enumerate(zip(q.labels, probs))]})
    usage = systemone["usage"]
    tokens = int(usage["input_tokens"])
    return {"model": systemone["model"], "answers": answers,
            "usage": {"input_tokens": tokens,
                      "input_tokens_details": {"cached_tokens": int(usage.get("cached_state_tokens", 0)),
                                               "cache_write_tokens": 0},
                      "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": tokens}}
