"""Human-readable output: the one-screen bench table, the server-vs-baseline table, the parity summary."""

from __future__ import annotations

from typing import Any, Sequence

from clef_vllm.server.context import STAGES


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 10000:
        return f"{x / 1000:.1f}k"
    return f"{x:.{digits}f}"


def _ms(d: dict | None, key: str) -> str:
    return "-" if not d or d.get(key) is None else _num(d[key], 1)


def _errors(point: dict) -> str:
    errs = point.get("errors") or {}
    return ",".join(f"{k}:{v}" for k, v in errs.items()) or "0"


def _tokens(point: dict) -> str:
    t = point.get("input_tokens") or {}
    mean = t.get("mean_expected")
    base = "-" if mean is None else f"{mean:.0f}"
    if t.get("mismatches"):
        return f"{base} ({t['mismatches']}/{t['checked']} MISMATCH)"
    base += " ok" if t.get("checked") else ""
    if t.get("cached"):  # the state cache answered part of the prompts
        base += f", {100 * t.get('cached_share', 0):.0f}% cached"
    return base


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


BENCH_HEADER = ("variant", "c", "ok/n", "errors", "req/s", "in tok/s", "q/s", "p50 ms", "p90 ms", "p99 ms",
                "tokens/req")


def bench_row(p: dict) -> list[str]:
    lat = p.get("latency_ms")
    return [p["variant"], str(p["concurrency"]), f"{p['ok']}/{p['requests']}", _errors(p), _num(p["req_per_s"], 2),
            _num(p["input_tok_per_s"], 0), _num(p["questions_per_s"], 1), _ms(lat, "p50"), _ms(lat, "p90"),
            _ms(lat, "p99"), _tokens(p)]


def bench_table(results: dict) -> str:
    """One line per (variant, concurrency) point."""
    title = f"clef-bench {results.get('mode')}: {_target_name(results)}"
    if results.get("label"):
        title += f"  [{results['label']}]"
    if results.get("complete") is False:
        title += "  (PARTIAL: the run stopped before its last point)"
    rows = [bench_row(p) for p in results.get("points", [])]
    text = title + "\n" + _table(BENCH_HEADER, rows, right=set(range(1, len(BENCH_HEADER) - 1)))
    stages = stages_table(results)
    return text + ("\n\n" + stages if stages else "")


def stages_table(results: dict) -> str | None:
    """Where the server's time went, per point: the median of each Server-Timing stage (ms); ``None``
    when no point has them (another server, or a run before the bench recorded them)."""
    points = [p for p in results.get("points", []) if p.get("server_stages_p50_ms")]
    if not points:
        return None
    seen = {name for p in points for name in p["server_stages_p50_ms"]}
    names = [n for n in STAGES if n in seen] + sorted(seen - set(STAGES))   # the server's order first
    rows = [[p["variant"], str(p["concurrency"]), *(_num(p["server_stages_p50_ms"].get(n), 1) for n in names)]
            for p in points]
    return "server time per stage, p50 ms (Server-Timing)\n" + _table(["variant", "c", *names], rows,
                                                                       right=set(range(1, len(names) + 2)))


def _target_name(results: dict) -> str:
    t = results.get("target") or {}
    return t.get("url") or t.get("model_dir") or "?"


def compare_points(baseline: dict, result: dict) -> list[dict]:
    """Join two bench results on (variant, concurrency): throughput and latency ratios result/baseline."""
    base = {(p["variant"], p["concurrency"]): p for p in baseline.get("points", [])}
    out = []
    for p in result.get("points", []):
        b = base.get((p["variant"], p["concurrency"]))
        if b is None:
            continue

        def ratio(x, y):
            return round(x / y, 4) if x is not None and y not in (None, 0) else None

        lat_r = (p.get("latency_ms") or {}).get("p50")
        lat_b = (b.get("latency_ms") or {}).get("p50")
        out.append({
            "variant": p["variant"], "concurrency": p["concurrency"],
            "baseline_tok_per_s": b["input_tok_per_s"], "result_tok_per_s": p["input_tok_per_s"],
            "throughput_ratio": ratio(p["input_tok_per_s"], b["input_tok_per_s"]),
            "baseline_p50_ms": lat_b, "result_p50_ms": lat_r, "p50_ratio": ratio(lat_r, lat_b),
            "baseline_req_per_s": b["req_per_s"], "result_req_per_s": p["req_per_s"],
            "baseline_errors": b.get("errors") or {}, "result_errors": p.get("errors") or {},
        })
    return out


def compare_table(rows: Sequence[dict], baseline_name: str, result_name: str) -> str:
    header = ("variant", "c", "base tok/s", "tok/s", "tput ratio", "base p50", "p50", "p50 ratio")
    body = [[r["variant"], str(r["concurrency"]), _num(r["baseline_tok_per_s"], 0), _num(r["result_tok_per_s"], 0),
             _num(r["throughput_ratio"], 3), _num(r["baseline_p50_ms"]), _num(r["result_p50_ms"]),
             _num(r["p50_ratio"], 2)] for r in rows]
    title = (f"{result_name} vs baseline {baseline_name}  "
             f"(tput ratio = tok/s ÷ base tok/s; p50 ratio = p50 ÷ base p50)")
    return title + "\n" + _table(header, body, right=set(range(1, len(header))))


# --------------------------------------------------------------------------- parity


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def _f(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def parity_markdown(receipt: dict) -> str:
    """The short markdown summary of a parity receipt."""
    a, b = receipt["a"], receipt["b"]
    rs = receipt["request_set"]
    cmp_ = receipt["comparison"]
    noise = receipt.get("noise_floor") or {}
    lines = [f"# clef-parity: `{a['spec']}` (A) vs `{b['spec']}` (B)", ""]
    lines.append(f"- Request set: {rs['source']}, {rs['requests']} requests, {rs['questions']['total']} questions "
                 f"(noul {rs['questions']['noul']}, choice {rs['questions']['choice']}, score "
                 f"{rs['questions']['score']}); sha256 `{rs['sha256'][:16]}`")
    cond = receipt["conditions"]
    lines.append(f"- A vs B: both at {_cond(cond['main'])}; compared {cmp_['requests_compared']}/{cmp_['requests']} "
                 f"requests")
    for side, sec in noise.items():
        lines.append(f"- Noise floor {side}: {side} at {_cond(sec['condition'])} vs {side} at {_cond(cond['main'])}")
    if cmp_["status_pairs_not_compared"]:
        lines.append(f"- Not compared (A/B status): {cmp_['status_pairs_not_compared']}")
    if cmp_["input_token_mismatches"]:
        lines.append(f"- **usage.input_tokens differs on {cmp_['input_token_mismatches']} requests**")
    if cmp_.get("cached_requests"):
        hit, rest = cmp_["overall_cached"], cmp_["overall_uncached"]
        lines.append(f"- Answered from a cached state: {cmp_['cached_requests']} requests (cached state tokens "
                     f"A {cmp_['cached_state_tokens']['a']}, B {cmp_['cached_state_tokens']['b']}); their questions: "
                     f"top-1 {_pct(hit['top1_agreement'])}, max abs Δp {_f(hit['max_abs_dp'])}, {hit['flips']} flips; "
                     f"the others: top-1 {_pct(rest['top1_agreement'])}, max abs Δp {_f(rest['max_abs_dp'])}, "
                     f"{rest['flips']} flips")
    lines += [f"- {line}" for line in verdict_lines(receipt)]
    for side, acc in (receipt.get("accuracy") or {}).items():
        parts = [f"{t} {_pct(acc['per_type'][t]['accuracy'])} (n {acc['per_type'][t]['questions']})"
                 for t in ("noul", "choice", "score") if acc["per_type"][t]["questions"]]
        lines.append(f"- Accuracy of {side} against the answer keys: overall {_pct(acc['overall']['accuracy'])}; "
                     + ", ".join(parts) + (f"; {acc['unanswered']} unanswered" if acc["unanswered"] else ""))
    lines.append("")
    header = "| type | questions | top-1 agreement | mean TV | mean KL | max abs Δp | flips |"
    cols = ["A vs B"] + [f"noise {side}" for side in noise]
    lines += [header.replace("| type |", "| run | type |"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in ("noul", "choice", "score", "overall"):
        for name, sec in zip(cols, [cmp_] + [noise[s]["comparison"] for s in noise]):
            st = sec["overall"] if t == "overall" else sec["per_type"][t]
            if not st["questions"]:
                continue
            lines.append(f"| {name} | {t} | {st['questions']} | {_pct(st['top1_agreement'])} | {_f(st['mean_tv'])} | "
                         f"{_f(st['mean_kl'], 5)} | {_f(st['max_abs_dp'])} | {st['flips']} |")
    lines.append("")
    flips = cmp_["flips"]
    if flips:
        lines += ["## Flips A vs B (largest A margin first)", "",
                  "| request | question | type | A top | B top | A margin | B margin | TV |",
                  "|---|---|---|---|---|---:|---:|---:|"]
        for f in flips[:20]:
            lines.append(f"| {f['label']} | {f['question']} | {f['type']} | {f['a_top']} | {f['b_top']} | "
                         f"{f['a_margin']:.4f} | {f['b_margin']:.4f} | {f['tv']:.4f} |")
        if len(flips) > 20:
            lines.append(f"| … {len(flips) - 20} more in the JSON receipt | | | | | | | |")
    else:
        lines.append("No flips between A and B.")
    lines.append("")
    lines.append(f"Command: `{' '.join(receipt.get('argv') or [])}`")
    return "\n".join(lines) + "\n"


def verdict_lines(receipt: dict) -> list[str]:
    """A vs B overall, next to each noise floor (agreement gap and TV ratio)."""
    ab = receipt["comparison"]["overall"]
    if not ab["questions"]:
        return ["No question was answered by both sides."]
    out = [f"A vs B overall: top-1 {_pct(ab['top1_agreement'])}, mean TV {_f(ab['mean_tv'])}, "
           f"max |Δp| {_f(ab['max_abs_dp'])}, {ab['flips']} flips"]
    for side, sec in (receipt.get("noise_floor") or {}).items():
        nf = sec["comparison"]["overall"]
        if not nf["questions"]:
            continue
        ratio = ("n/a" if not nf["mean_tv"] else f"{ab['mean_tv'] / nf['mean_tv']:.1f}× the noise floor")
        out.append(f"noise floor {side}: top-1 {_pct(nf['top1_agreement'])}, mean TV {_f(nf['mean_tv'])}, "
                   f"max |Δp| {_f(nf['max_abs_dp'])}, {nf['flips']} flips → A-vs-B mean TV is {ratio}")
    return out


def _cond(c: dict) -> str:
    order = "request order" if c["order"] == "request" else f"shuffled order (seed {c.get('seed', 0)})"
    return f"concurrency {c['concurrency']}, {order}"


def parity_table(receipt: dict) -> str:
    """A compact plain-text version for the terminal."""
    cmp_ = receipt["comparison"]
    noise = receipt.get("noise_floor") or {}
    header = ("run", "type", "n", "top-1", "mean TV", "mean KL", "max |dp|", "flips")
    rows: list[list[Any]] = []
    for name, sec in [("A vs B", cmp_)] + [(f"noise {s}", noise[s]["comparison"]) for s in noise]:
        for t in ("noul", "choice", "score", "overall"):
            st = sec["overall"] if t == "overall" else sec["per_type"][t]
            if st["questions"]:
                rows.append([name, t, str(st["questions"]), _pct(st["top1_agreement"]), _f(st["mean_tv"]),
                             _f(st["mean_kl"], 5), _f(st["max_abs_dp"]), str(st["flips"])])
    return _table(header, rows, right={2, 3, 4, 5, 6, 7})
