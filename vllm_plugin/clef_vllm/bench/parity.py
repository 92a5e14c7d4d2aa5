"""Answer fidelity between two runs over the same request set.

Each answered question becomes a probability vector over its options: noul ``[P(true),
P(false)]``, choice ``probabilities`` (B's vector re-ordered by A's option ids), score
``probabilities`` by level. Per question type (and overall) the comparison reports:

* **top-1 agreement**: the share of questions whose top answer is the same (noul: ``P(true) >= 0.5``;
  choice: the ``choice`` field; score: the most probable level, first on ties);
* **mean TV**: total-variation distance ``½ Σ |pA − pB|``, averaged;
* **mean KL**: ``KL(A‖B) = Σ pA log(pA/pB)`` in nats, both vectors floored at 1e-6 and renormalised
  (answers carry 4 decimals, so values below ~1e-4 are at the rounding resolution);
* **max |Δp|**: the largest single-option probability difference seen;
* **flips**: every question whose top answer differs, with A's top-2 margin (a flip on a near-tie
  is expected noise; a flip at a large margin is a bug).

A is the reference side: margins are A's, KL is taken from A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from clef_vllm.bench.targets import Answered

QUESTION_TYPES = ("noul", "choice", "score")
KL_FLOOR = 1e-6


@dataclass
class Distribution:
    """One answer as labels, probabilities and the top label."""

    type: str
    labels: list[str]
    probs: list[float]
    top: str
    score: float | None = None

    @property
    def margin(self) -> float:
        """Top-1 minus top-2 probability."""
        s = sorted(self.probs, reverse=True)
        return s[0] - (s[1] if len(s) > 1 else 0.0)


def distribution(answer: dict) -> Distribution:
    """Read one SystemOne answer; raises ValueError on a malformed answer."""
    kind = answer.get("type")
    if kind == "noul":
        p = float(answer["noul"])
        return Distribution("noul", ["true", "false"], [p, 1.0 - p], "true" if p >= 0.5 else "false")
    if kind in ("choice", "score"):
        probs = answer["probabilities"]
        labels = [str(k) for k in probs]
        values = [float(v) for v in probs.values()]
        if not values:
            raise ValueError("empty probabilities")
        if kind == "choice":
            top = str(answer["choice"])
        else:
            top = labels[max(range(len(values)), key=lambda i: (values[i], -i))]
        return Distribution(kind, labels, values, top, float(answer["score"]) if kind == "score" else None)
    raise ValueError(f"unknown answer type {kind!r}")


def total_variation(p: Sequence[float], q: Sequence[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def kl_divergence(p: Sequence[float], q: Sequence[float], floor: float = KL_FLOOR) -> float:
    """KL(p‖q) in nats with both vectors floored at ``floor`` and renormalised."""
    p = [max(x, floor) for x in p]
    q = [max(x, floor) for x in q]
    sp, sq = sum(p), sum(q)
    return max(0.0, sum((a / sp) * math.log((a / sp) / (b / sq)) for a, b in zip(p, q)))


@dataclass
class QuestionDiff:
    request: int
    label: str
    question: str
    type: str
    a_top: str
    b_top: str
    a_margin: float
    b_margin: float
    tv: float
    kl: float
    max_abs_dp: float
    abs_d_score: float | None

    @property
    def flipped(self) -> bool:
        return self.a_top != self.b_top

    def row(self) -> dict:
        d = {"request": self.request, "label": self.label, "question": self.question, "type": self.type,
             "a_top": self.a_top, "b_top": self.b_top, "a_margin": round(self.a_margin, 4),
             "b_margin": round(self.b_margin, 4), "tv": round(self.tv, 6), "max_abs_dp": round(self.max_abs_dp, 6)}
        if self.abs_d_score is not None:
            d["abs_d_score"] = round(self.abs_d_score, 6)
        return d


def _aggregate(diffs: Sequence[QuestionDiff]) -> dict:
    n = len(diffs)
    if n == 0:
        return {"questions": 0, "top1_agreement": None, "flips": 0, "mean_tv": None, "p99_tv": None,
                "max_tv": None, "mean_kl": None, "max_abs_dp": None}
    tvs = sorted(d.tv for d in diffs)
    flips = sum(d.flipped for d in diffs)
    out = {
        "questions": n,
        "top1_agreement": round(1.0 - flips / n, 6),
        "flips": flips,
        "mean_tv": round(sum(tvs) / n, 6),
        "p99_tv": round(tvs[min(n - 1, math.ceil(0.99 * n) - 1)], 6),
        "max_tv": round(tvs[-1], 6),
        "mean_kl": round(sum(d.kl for d in diffs) / n, 7),
        "max_abs_dp": round(max(d.max_abs_dp for d in diffs), 6),
    }
    scores = [d.abs_d_score for d in diffs if d.abs_d_score is not None]
    if scores:
        out["mean_abs_d_score"] = round(sum(scores) / len(scores), 6)
    return out


def compare_runs(labels: Sequence[str], a: Sequence[Answered], b: Sequence[Answered], *,
                 max_flips: int = 100, max_worst: int = 10) -> dict:
    """Compare two runs over the same requests (index-aligned). Returns the receipt section."""
    diffs: list[QuestionDiff] = []
    status_pairs: dict[str, int] = {}
    token_mismatches: list[dict] = []
    problems: list[dict] = []
    cached = {"a": 0, "b": 0}                 # usage.cached_state_tokens (a server with --state-cache on)
    hit_requests: set[int] = set()            # requests either side answered from a cached state
    for i, (ra, rb) in enumerate(zip(a, b)):
        if not (ra.ok and rb.ok):
            key = f"{ra.status}/{rb.status}"
            status_pairs[key] = status_pairs.get(key, 0) + 1
            if ra.status != rb.status and len(problems) < max_flips:
                problems.append({"request": i, "label": labels[i], "a_status": ra.status, "b_status": rb.status,
                                 "a_error": ra.error, "b_error": rb.error})
            continue
        ta = (ra.body.get("usage") or {}).get("input_tokens")
        tb = (rb.body.get("usage") or {}).get("input_tokens")
        if ta != tb:
            token_mismatches.append({"request": i, "label": labels[i], "a": ta, "b": tb})
        for side, res in (("a", ra), ("b", rb)):
            n = int((res.body.get("usage") or {}).get("cached_state_tokens") or 0)
            cached[side] += n
            if n:
                hit_requests.add(i)
        answers_a, answers_b = ra.body.get("answers") or {}, rb.body.get("answers") or {}
        for qid, ans_a in answers_a.items():
            ans_b = answers_b.get(qid)
            try:
                da = distribution(ans_a)
                if ans_b is None:
                    raise ValueError("missing in B")
                db = distribution(ans_b)
                if db.type != da.type or sorted(db.labels) != sorted(da.labels):
                    raise ValueError(f"shape differs: {da.type}{da.labels} vs {db.type}{db.labels}")
            except (ValueError, KeyError, TypeError) as exc:
                if len(problems) < max_flips:
                    problems.append({"request": i, "label": labels[i], "question": qid, "error": str(exc)[:200]})
                continue
            qb = dict(zip(db.labels, db.probs))
            pb = [qb[label] for label in da.labels]
            diffs.append(QuestionDiff(
                request=i, label=labels[i], question=qid, type=da.type, a_top=da.top, b_top=db.top,
                a_margin=da.margin, b_margin=db.margin, tv=total_variation(da.probs, pb),
                kl=kl_divergence(da.probs, pb), max_abs_dp=max(abs(x - y) for x, y in zip(da.probs, pb)),
                abs_d_score=abs(da.score - db.score) if da.score is not None and db.score is not None else None))
    per_type = {t: _aggregate([d for d in diffs if d.type == t]) for t in QUESTION_TYPES}
    flips = sorted((d for d in diffs if d.flipped), key=lambda d: -d.a_margin)
    worst = sorted((d for d in diffs if not d.flipped), key=lambda d: -d.tv)[:max_worst]
    both_ok = sum(1 for ra, rb in zip(a, b) if ra.ok and rb.ok)
    return {
        "requests": len(a),
        "requests_compared": both_ok,
        "status_pairs_not_compared": dict(sorted(status_pairs.items())),
        "per_type": per_type,
        "overall": _aggregate(diffs),
        "flips": [d.row() for d in flips[:max_flips]],
        "flips_listed": min(len(flips), max_flips),
        "worst_non_flips": [d.row() for d in worst],
        "input_token_mismatches": len(token_mismatches),
        "input_token_mismatch_examples": token_mismatches[:10],
        "problems": problems,
        "cached_state_tokens": cached,
        # the same agreement over the questions of requests answered from a cached state on a side
        "cached_requests": len(hit_requests),
        "overall_cached": _aggregate([d for d in diffs if d.request in hit_requests]),
        "overall_uncached": _aggregate([d for d in diffs if d.request not in hit_requests]),
    }


def accuracy(run: Sequence[Answered], bodies: Sequence[dict], keys: Sequence[dict | None]) -> dict:
    """Top-1 accuracy of one run against answer keys (``{question_id: correct option id}``, as
    build_data writes them), per question type. A question the run did not answer counts as wrong."""
    tally = {t: [0, 0] for t in QUESTION_TYPES}
    unanswered = 0
    for res, body, key in zip(run, bodies, keys):
        for qid, correct in (key or {}).items():
            qtype = ((body.get("questions") or {}).get(qid) or {}).get("type")
            if qtype not in tally:
                continue
            tally[qtype][1] += 1
            try:
                top = distribution(res.body["answers"][qid]).top if res.ok else None
            except (KeyError, ValueError, TypeError):
                top = None
            unanswered += top is None
            tally[qtype][0] += int(top is not None and top == str(correct))

    def row(correct: int, n: int) -> dict:
        return {"questions": n, "correct": correct, "accuracy": round(correct / n, 6) if n else None}

    return {"per_type": {t: row(*tally[t]) for t in QUESTION_TYPES}, "unanswered": unanswered,
            "overall": row(sum(c for c, _ in tally.values()), sum(n for _, n in tally.values()))}


def count_questions(bodies: Sequence[dict]) -> dict[str, Any]:
    """Questions per type in a request set."""
    counts = {t: 0 for t in QUESTION_TYPES}
    for b in bodies:
        qs = b.get("questions")
        if isinstance(qs, dict):
            for q in qs.values():
                t = q.get("type") if isinstance(q, dict) else None
                if t in counts:
                    counts[t] += 1
    counts["total"] = sum(counts[t] for t in QUESTION_TYPES)
    return counts
