"""An independent oracle for record encoding (docs/encoding-and-head.md): literal copies of the release's
fixed text (NOT imported from clef_vllm/schema/encoding.py) and the documented segment sequence built one
segment at a time with any tokenizer; shared by tests/test_encoding.py and tests/test_encoding_pieces.py."""

from __future__ import annotations

import json

from clef_vllm.schema.dialects import parse_request

# Literal copies of the release's fixed text (docs/encoding-and-head.md), NOT imported from encoding.py.
SYS = ("Read the complete state and schema. Decide every field jointly. "
       "Each answer must be exactly one of that field's allowed options.")
PREFIX = "<|im_start|>system\n" + SYS + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA = "\n\nSCHEMA FIELDS:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
NOUL_TRUE = "The proposition is true or the answer is yes."
NOUL_FALSE = "The proposition is false or the answer is no."

IM_START, IM_END, THINK, END_THINK = 248045, 248046, 248068, 248069


def req(state="Checkout is down.", **questions) -> dict:
    return {"model": "clef-flash", "state": state,
            "questions": questions or {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}


def encode(enc, data, **kw):
    return enc.encode(parse_request(data), **kw)


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


def spec_encode(T, data: dict, keep_state: int | None = None, media: list[int] = ()):
    """The documented segment sequence, literally: (ids, [(question span, [option spans])], state length);
    ``media``: the processor's media ids, which go right after the prefix."""
    prefix, state = T(PREFIX) + list(media), T(spec_render(data["state"]))
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
