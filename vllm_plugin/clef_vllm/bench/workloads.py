"""Deterministic request sets with known token counts.

Every generated request is a plain SystemOne body. Its expected ``usage.input_tokens`` is
computed with the project's own encoder (:class:`clef_vllm.schema.encoding.RequestEncoder`) on the
checkpoint's tokenizer, so a server that reports another count is encoding differently.

Sizes: ``short`` and ``long`` variants aim at a TOTAL input-token count (state + template +
schema, what ``usage.input_tokens`` reports); ``fanout`` variants share one STATE size and add
questions. The state text is grown word by word until it has exactly the tokens it needs: the
Qwen3.5 pre-tokenizer splits at every word and punctuation boundary, so token costs of the pieces
add up, and the final count is re-checked against the tokenizer.

Request ``i`` of a variant depends only on ``(seed, variant, i)``, never on how many requests are
drawn, so runs with different ``-n`` share their first requests.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

WORKLOADS = ("short", "long", "fanout", "mixed", "shared-state")
DEFAULT_SHORT_TOKENS = 360  # the template + 3 compact questions take ~280-320 (Qwen3.5 tokenizer)
DEFAULT_LONG_TOKENS = (4096, 16384)
DEFAULT_FANOUT_STATE_TOKENS = 4096
DEFAULT_FANOUT_QUESTIONS = (1, 8, 32, 64)
#: ``shared-state``: every request of a variant asks 3 new questions (~100-150 unique tokens) about
#: ONE state of this many tokens; (state tokens, requests per point[, states]). 15,872 + template +
#: schema still fits the 16,384-token limit. With a third number the requests go round-robin over that
#: many states (request i asks about state i mod states), so each state gets requests/states of them:
#: the affinity case of data-parallel serving, where a follow-up must find the engine holding its state.
DEFAULT_SHARED_STATES = ((4096, 64), (15872, 33))
#: Warm-up requests are numbered from here (``bench_cli``); a multi-state variant gives them states of
#: their own, so warming up does not put the measured states in the cache.
WARM_START = 1_000_000
#: ``mixed``: share of requests per component (jpetrucciani's 50 % short / 25 % 4k / 25 % 16k).
MIXED_SHARES = (("short", 0.5), ("long-first", 0.25), ("long-last", 0.25))

_NOUNS = (
    "customer order invoice payment refund account ticket checkout cart shipment delivery address server "
    "database network service outage deployment release dashboard report contract vendor subscription plan "
    "upgrade login password email phone message agent team manager engineer region cluster latency error "
    "warning alert incident queue backlog budget forecast quarter migration certificate domain firewall "
    "policy review request approval schedule meeting calendar product feature bug crash update device"
).split()
_VERBS = (
    "reported noticed confirmed requested escalated cancelled approved rejected delayed restarted updated "
    "failed recovered charged refunded shipped received blocked opened closed merged deployed flagged "
    "reviewed scheduled migrated renewed expired paused resumed exceeded dropped"
).split()
_ADJS = (
    "urgent minor major critical slow fast new old pending overdue duplicate missing broken stable "
    "intermittent unexpected recurring partial complete manual automatic internal external secure "
    "public private monthly weekly daily large small"
).split()
_SMALL = "the a an this that our their its some every each no one".split()
_PREPS = "for after before during since from with without about on in at by".split()
_TIMES = "today yesterday this morning last night twice again since Monday every hour".split()


# --------------------------------------------------------------------------- question banks
# Each entry gives one question; picked with a seeded rng. Compact: with the Qwen3.5 tokenizer the
# prompt template plus one question of each type takes ~280-320 tokens before any state.

_NOUL_BANK = (
    "Is this urgent?", "Is a refund requested?", "Is the customer angry?", "Is this spam?",
    "Does it mention an outage?", "Is a reply needed today?", "Is this a security issue?",
    "Is the account at risk?", "Is personal data exposed?", "Should a human review it?",
)
_CHOICE_BANK = (
    ("Which team?", {"billing": "Payments", "technical": "Outages", "sales": "Plans"}),
    ("What is the sentiment?", {"positive": None, "neutral": None, "negative": None}),
    ("Which channel?", {"email": "Email", "chat": "Live chat", "phone": "Phone call"}),
    ("What kind of request?", {"question": "A question", "complaint": "A complaint", "request": "A request"}),
    ("Which product area?", {"api": "API", "web": "Website", "mobile": "Mobile app"}),
    ("What is the status?", {"open": "Open", "pending": "Waiting", "resolved": "Resolved"}),
)
_SCORE_BANK = (
    ("How severe?", ["None", "Minor", "Major", "Critical"]),
    ("How likely is churn?", ["Low", "Medium", "High"]),
    ("Priority?", ["P4", "P3", "P2", "P1"]),
    ("How clear is the message?", ["Unclear", "Partly clear", "Clear", "Very clear"]),
    ("Effort to fix?", ["Small", "Medium", "Large"]),
)


def question_set(rng: random.Random, n: int) -> dict[str, dict]:
    """``n`` questions cycling noul, choice, score (``n == 3``: one of each), ids unique and ordered."""
    questions: dict[str, dict] = {}
    for k in range(n):
        kind = ("noul", "choice", "score")[k % 3]
        qid = f"q{k + 1:02d}_{kind}" if n > 3 else kind
        if kind == "noul":
            questions[qid] = {"type": "noul", "instructions": rng.choice(_NOUL_BANK)}
        elif kind == "choice":
            text, criteria = rng.choice(_CHOICE_BANK)
            items = list(criteria.items())
            rng.shuffle(items)  # wire order differs from the sorted encoded order
            questions[qid] = {"type": "choice", "instructions": text, "criteria": dict(items)}
        else:
            text, levels = rng.choice(_SCORE_BANK)
            questions[qid] = {"type": "score", "instructions": text, "criteria": list(levels)}
    return questions


# --------------------------------------------------------------------------- state text


class StateWriter:
    """Writes plausible ticket-like English with an exact token count for one tokenizer."""

    def __init__(self, encoder):
        self._encoder = encoder
        self._costs: dict[str, int] = {}
        self._fillers = [p for p in (" the", " a", " and", " to", " of", " is", " in", " it", " on", ".")
                         if self.cost(p) == 1] or [" a"]

    def cost(self, piece: str) -> int:
        """Tokens of one piece tokenized alone (memoised)."""
        c = self._costs.get(piece)
        if c is None:
            c = self._costs[piece] = len(self._encoder.tokenize(piece))
        return c

    def count(self, text: str) -> int:
        return len(self._encoder.tokenize(text))

    def _sentence(self, rng: random.Random, start: bool) -> list[str]:
        words = [rng.choice(_SMALL).capitalize(), rng.choice(_NOUNS), rng.choice(_VERBS)]
        for _ in range(rng.randint(1, 3)):
            words += [rng.choice(_PREPS), rng.choice(_SMALL), rng.choice(_ADJS), rng.choice(_NOUNS)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(2, 99999)))
        if rng.random() < 0.5:
            words += rng.choice(_TIMES).split()
        pieces = [words[0] if start else " " + words[0]] + [" " + w for w in words[1:]]
        pieces.append(rng.choice([".", ".", ".", "?", "!"]))
        return pieces

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """A state string of exactly ``n_tokens`` tokens (nearest reachable count if not exact)."""
        if n_tokens <= 0:
            return ""
        pieces: list[str] = []
        total, sentences = 0, 0
        while True:
            start = not pieces or pieces[-1] == "\n\n"
            sentence = self._sentence(rng, start)
            costs = [self.cost(p) for p in sentence]
            if total + sum(costs) > n_tokens:
                for p, c in zip(sentence, costs):  # take what fits of the last sentence
                    if total + c > n_tokens:
                        break
                    pieces.append(p)
                    total += c
                break
            pieces += sentence
            total += sum(costs)
            sentences += 1
            if sentences % 6 == 0 and total + self.cost("\n\n") <= n_tokens:
                pieces.append("\n\n")
                total += self.cost("\n\n")
        while total < n_tokens:
            pieces.append(rng.choice(self._fillers))
            total += 1
        text = "".join(pieces)
        for _ in range(8):  # the additive estimate is exact for Qwen-style pre-tokenizers; re-check
            actual = self.count(text)
            if actual == n_tokens:
                break
            if actual < n_tokens:
                text += "".join(rng.choice(self._fillers) for _ in range(n_tokens - actual))
            else:
                text = _cut_words(text, actual - n_tokens)
        return text


def _cut_words(text: str, n: int) -> str:
    """Drop ``n`` space-separated words from the end (at least one)."""
    parts = text.rsplit(" ", max(1, n))
    return parts[0] if len(parts) > 1 else text[: max(0, len(text) - n)]


# --------------------------------------------------------------------------- variants and requests


@dataclass(frozen=True)
class Variant:
    """One request shape of a workload. ``total_tokens`` OR ``state_tokens`` fixes the size."""

    name: str
    workload: str
    questions: int = 3
    total_tokens: int | None = None
    state_tokens: int | None = None
    parts: tuple[tuple["Variant", float], ...] = ()  # mixed: component variants and their shares
    requests: int | None = None     # requests per point when -n is not given (shared-state)
    states: int = 1                 # shared-state: distinct states the requests go round-robin over

    @property
    def typical_tokens(self) -> float | None:
        """The intended total size (a mix: its share-weighted mean); None when only the state is fixed."""
        if self.parts:
            return sum(share * (v.total_tokens or 0) for v, share in self.parts)
        return self.total_tokens

    def describe(self) -> dict:
        d = {"name": self.name, "workload": self.workload, "questions": self.questions}
        if self.total_tokens is not None:
            d["target_total_tokens"] = self.total_tokens
        if self.state_tokens is not None:
            d["target_state_tokens"] = self.state_tokens
        if self.states > 1:
            d["states"] = self.states
        if self.parts:
            d["parts"] = {v.name: share for v, share in self.parts}
        return d


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def build_variants(workloads: Sequence[str], *, short_tokens: int = DEFAULT_SHORT_TOKENS,
                   long_tokens: Sequence[int] = DEFAULT_LONG_TOKENS,
                   fanout_state_tokens: int = DEFAULT_FANOUT_STATE_TOKENS,
                   fanout_questions: Sequence[int] = DEFAULT_FANOUT_QUESTIONS,
                   shared_states: Sequence[tuple[int, ...]] = DEFAULT_SHARED_STATES) -> list[Variant]:
    """The variants of the named workloads, in order (``mixed`` = 50 % short, 25 % first long, 25 % last long;
    ``shared-state`` = many requests about one state per variant)."""
    short = Variant("short", "short", 3, total_tokens=short_tokens)
    longs = [Variant(f"long-{_k(n)}", "long", 3, total_tokens=n) for n in long_tokens]
    out: list[Variant] = []
    for w in workloads:
        if w == "short":
            out.append(short)
        elif w == "long":
            out += longs
        elif w == "fanout":
            out += [Variant(f"fanout-{q}q", "fanout", q, state_tokens=fanout_state_tokens) for q in fanout_questions]
        elif w == "mixed":
            if not longs:
                raise ValueError("mixed needs at least one long size")
            parts = ((short, MIXED_SHARES[0][1]), (longs[0], MIXED_SHARES[1][1]), (longs[-1], MIXED_SHARES[2][1]))
            out.append(Variant("mixed", "mixed", 3, parts=parts))
        elif w == "shared-state":
            for n, r, *k in shared_states:
                states = k[0] if k else 1
                name = f"shared-{_k(n)}" + (f"-{states}s" if states > 1 else "")
                out.append(Variant(name, "shared-state", 3, state_tokens=n, requests=r, states=states))
        else:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)} (or --requests FILE)")
    return out


@dataclass
class BenchRequest:
    """One request to send: the body, its bytes, and what the server should report."""

    variant: str
    body: dict
    payload: bytes
    questions: int
    expected_tokens: int | None          # None: unknown (no tokenizer) or not encodable
    expected_status: int = 200
    input_ids: array | None = field(default=None, repr=False)  # the encoder's ids (raw-vLLM baseline)
    label: str = ""


def _rng(seed: int, *parts: Any) -> random.Random:
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class RequestFactory:
    """Makes :class:`BenchRequest` objects with one tokenizer/encoder and one seed."""

    def __init__(self, encoder=None, *, seed: int = 0, model: str = "clef-flash", keep_ids: bool = False):
        self.encoder = encoder
        self.seed = seed
        self.model = model
        self.keep_ids = keep_ids
        self.writer = StateWriter(encoder) if encoder is not None else None
        self._states: dict[tuple, str] = {}

    # ---- encoding
    def finish(self, variant: str, body: dict, label: str = "") -> BenchRequest:
        """Encode ``body`` (when a tokenizer is known) to attach expected tokens and status."""
        questions = len(body.get("questions") or {}) if isinstance(body.get("questions"), dict) else 0
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        req = BenchRequest(variant, body, payload, questions, None, label=label)
        if self.encoder is None:
            return req
        from clef_vllm.schema.dialects import parse_request
        from clef_vllm.schema.protocol import RequestError
        from clef_vllm.server.errors import outcome

        try:
            enc = self.encoder.encode(parse_request(body, limits=self.encoder.request_limits()))
        except RequestError as exc:
            req.expected_status = outcome(exc).status
            return req
        req.expected_tokens = enc.num_tokens
        if self.keep_ids:
            req.input_ids = array("i", enc.input_ids)
        return req

    def _fixed_tokens(self, body: dict) -> int:
        """Tokens of ``body`` with an empty state (template + schema)."""
        from clef_vllm.schema.dialects import parse_request

        return self.encoder.encode(parse_request({**body, "state": ""}), max_length=1 << 30).num_tokens

    # ---- generated workloads
    def make(self, variant: Variant, i: int) -> BenchRequest:
        """Request ``i`` of ``variant`` (deterministic in seed, variant name and ``i``)."""
        if self.encoder is None:
            raise ValueError("generated workloads need the checkpoint's tokenizer (--tokenizer DIR)")
        if variant.parts:
            return self._make_mixed(variant, i)
        if variant.workload == "shared-state":
            which = 0 if variant.states == 1 else ("warm", i) if i >= WARM_START else i % variant.states
            state = self._shared_state(variant.state_tokens, which)
            questions = question_set(_rng(self.seed, variant.name, "questions", i), variant.questions)
            body = {"model": self.model, "state": state, "questions": questions}
            return self.finish(variant.name, body, f"{variant.name}#{i}")
        if variant.workload == "fanout":
            state_rng = _rng(self.seed, "fanout-state", variant.state_tokens, i)  # same state for every fan-out
            state = self.writer.text(variant.state_tokens, state_rng)
            questions = question_set(_rng(self.seed, "fanout-questions", i), variant.questions)
            body = {"model": self.model, "state": state, "questions": questions}
            return self.finish(variant.name, body, f"{variant.name}#{i}")
        rng = _rng(self.seed, variant.name, i)
        questions = question_set(rng, variant.questions)
        body = {"model": self.model, "state": "", "questions": questions}
        state_tokens = max(0, variant.total_tokens - self._fixed_tokens(body))
        body["state"] = self.writer.text(state_tokens, rng)
        return self.finish(variant.name, body, f"{variant.name}#{i}")

    def _shared_state(self, tokens: int, which: Any = 0) -> str:
        """State ``which`` of a ``shared-state`` variant (the same in every run; 0 = the one state)."""
        key = (tokens, which)
        if key not in self._states:
            parts = ("shared-state", tokens) if which == 0 else ("shared-state", tokens, which)
            self._states[key] = self.writer.text(tokens, _rng(self.seed, *parts))
        return self._states[key]

    def _make_mixed(self, variant: Variant, i: int) -> BenchRequest:
        pick = _rng(self.seed, variant.name, "pick", i).random() * sum(share for _, share in variant.parts)
        chosen = variant.parts[-1][0]
        for part, share in variant.parts:
            if pick < share:
                chosen = part
                break
            pick -= share
        req = self.make(chosen, i)
        req.variant = variant.name
        return req

    def requests(self, variant: Variant, n: int, start: int = 0) -> list[BenchRequest]:
        return [self.make(variant, i) for i in range(start, start + n)]

    def min_total_tokens(self, variant: Variant) -> int:
        """Template + schema tokens of request 0 (a total-token target below this cannot be met)."""
        rng = _rng(self.seed, variant.name, 0)
        return self._fixed_tokens({"model": self.model, "state": "", "questions": question_set(rng, variant.questions)})


# --------------------------------------------------------------------------- request files


def request_set_digest(bodies: Iterable[dict]) -> str:
    """sha256 over the canonical JSON of the bodies, in order (two receipts with the same digest saw the same set)."""
    h = hashlib.sha256()
    for b in bodies:
        h.update(json.dumps(b, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


# --------------------------------------------------------------------------- synthetic parity set

_JSON_STATES = (
    lambda r: {"invoice": {"vendor": r.choice(["Acme", "Globex", "Initech"]), "total": round(r.uniform(5, 5000), 2),
                           "currency": r.choice(["USD", "EUR"]), "status": r.choice(["paid", "overdue", "draft"])}},
    lambda r: {"ticket": {"id": r.randint(1000, 99999), "priority": r.choice(["low", "high", None]),
                          "tags": r.sample(_ADJS, 3), "body": " ".join(r.choice(_NOUNS) for _ in range(12))}},
    lambda r: [{"role": r.choice(["user", "agent"]), "content": " ".join(r.choice(_NOUNS + _VERBS) for _ in range(10))}
               for _ in range(r.randint(2, 5))],
)


def synthetic_parity_set(n: int, seed: int = 0, model: str = "clef-flash", max_words: int = 400,
                         states: int | None = None) -> list[dict]:
    """``n`` varied requests for fidelity checks (no tokenizer needed).

    Mixes text and JSON states of 5-``max_words`` words, 1-6 questions, choice questions with 2-8
    options in unsorted wire order (some descriptions null), score scales of 2-10 levels, noul
    questions with and without criteria, and some structured (object) instructions. With ``states``,
    request ``i`` asks its questions about the state of request ``i % states``: later requests repeat
    earlier states, as the state cache expects (a server with it answers them from cached prefixes).
    """
    out = []
    for i in range(n):
        r = _rng(seed, "parity", i)
        if r.random() < 0.3:
            state: Any = r.choice(_JSON_STATES)(r)
        else:
            words = r.randint(min(5, max_words), max_words)
            state = " ".join(r.choice(_NOUNS + _VERBS + _ADJS + _SMALL) for _ in range(words)).capitalize() + "."
        questions: dict[str, dict] = {}
        for k in range(r.randint(1, 6)):
            kind = r.choice(("noul", "choice", "score"))
            qid = f"{kind}_{k}"
            if kind == "noul":
                q: dict = {"type": "noul", "instructions": r.choice(_NOUL_BANK)}
                if r.random() < 0.3:
                    q["criteria"] = {"true": "Yes, clearly.", "false": "No."}
            elif kind == "choice":
                ids = r.sample(_NOUNS, r.randint(2, 8))
                q = {"type": "choice", "instructions": r.choice(_CHOICE_BANK)[0],
                     "criteria": {o: (None if r.random() < 0.2 else f"About the {o}") for o in ids}}
            else:
                levels = r.randint(2, 10)
                q = {"type": "score", "instructions": r.choice(_SCORE_BANK)[0],
                     "criteria": [f"level {j}" for j in range(levels)]}
            if r.random() < 0.15:
                q["instructions"] = {"question": q["instructions"], "context": r.choice(_ADJS)}
            questions[qid] = q
        if states and i >= states:
            state = out[i % states]["state"]
        out.append({"model": model, "state": state, "questions": questions})
    return out
