"""The adversarial mix of ``bench/soak.py`` in its short form: a real ``clef-systemone`` (reference backend,
CPU) with every limit set (``MIX_SERVER_FLAGS``) under a small checked load while every hostile client of
the ``Attacks`` table runs at least once (the attackers' first round always runs to its end, so a load of a few
seconds is enough). The full form is the same command for 30 minutes and more
(``bench/results/soak_cpu.json`` says how it was run)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_every_attack_of_the_mix_gets_its_documented_answer_and_nothing_is_lost(tiny_release, cache_dir, tmp_path):
    out = tmp_path / "mix.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--launch", "--mix", "adversarial",
                           "--duration", "3", "--concurrency", "4", "--attackers", "3", "--out", str(out),
                           "--server-log", str(tmp_path / "server.log"), "--ready-timeout", "120",
                           "--", "--model", str(tiny_release), "--backend", "reference"],
                          capture_output=True, text=True, timeout=240)
    summary = json.loads(out.read_text()) if out.exists() else {}
    attacks = summary.get("attacks", {})
    assert attacks, proc.stdout + proc.stderr
    missing = [name for name, r in attacks.items() if r["runs"] == 0]
    failed = {name: r for name, r in attacks.items() if r["ok"] != r["runs"]}
    assert not missing and not failed, (missing, json.dumps(failed, indent=1))
    assert summary["responses_5xx"] == 0 and summary["lost"] == 0 and summary["misattributed"] == 0, summary
    assert summary["request_ids_in_log"]["ids_checked"] > 0
    assert summary["requests_detail"]["ok"] > 0 and summary["server_exit_code"] == 0
    assert "Traceback" not in (tmp_path / "server.log").read_text()
