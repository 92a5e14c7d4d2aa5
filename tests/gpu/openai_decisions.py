"""GPU check: OpenAI's Decisions route on the vLLM backend answers what ``/v1/systemone`` answers.

Starts ``clef-systemone --backend vllm`` on the demo checkpoint, asks one decision through
``POST /v1/decisions`` (a string input, then the same input as a user message) and through
``POST /v1/systemone``, and requires the same probabilities; then the bulk route and two errors
(over-length and ``input_image``) in OpenAI's envelope. Standard library only (no SDK on the GPU
machine; tests/test_openai_decisions.py runs the SDKs on the CPU).

Usage (GPU machine, clef-vllm and vLLM installed): ``python tests/gpu/openai_decisions.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from clef_vllm.testing.server import LiveServer

STATE = "Checkout has been failing for every customer for the last hour."
QUESTIONS = [
    {"type": "predicate", "name": "urgent", "instructions": "Is this support request urgent?"},
    {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
     "choices": [{"value": "technical", "description": "Outages"}, {"value": "billing"}, {"value": False}]},
    {"type": "score", "name": "severity", "instructions": "How severe?",
     "levels": [{"label": "Minor"}, {"label": "Major", "description": "Many users"}, {"label": "Critical"}]},
]
SYSTEMONE = {"model": "clef-flash", "state": STATE, "questions": {
    "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"technical": "Outages", "billing": None, "false": None}},
    "severity": {"type": "score", "instructions": "How severe?", "criteria": ["Minor", "Major: Many users", "Critical"]}}}


def probabilities(decision: dict) -> list:
    out = []
    for a in decision["answers"]:
        out.append(a["probability"] if a["type"] == "predicate" else [p["probability"] for p in a["probabilities"]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    server = LiveServer(["--model", "demo", "--backend", "vllm", "--gdn-prefill-backend", "triton",
                         "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"], ready_timeout=600)
    report: dict = {}
    try:
        server.wait_ready()
        status, text = server.call("/v1/systemone", SYSTEMONE, timeout=60)
        assert status == 200, text
        ref = json.loads(text)["answers"]
        expected = [ref["urgent"]["noul"], list(ref["team"]["probabilities"].values()),
                    list(ref["severity"]["probabilities"].values())]
        for name, input_value in (("string", STATE), ("message", [{"role": "user", "content": STATE}])):
            status, text = server.call("/v1/decisions", {"model": "clef-flash", "input": input_value,
                                                         "questions": QUESTIONS}, timeout=60)
            assert status == 200, text
            decision = json.loads(text)
            assert probabilities(decision) == expected, (decision, ref)
            assert decision["answers"][1]["choice"] in ("technical", "billing", False)
            report[name] = decision
        line = json.dumps({"model": "clef-flash", "input": STATE, "questions": QUESTIONS}).encode()
        req = urllib.request.Request(server.url + "/v1/decisions/bulk", data=line + b"\n" + line + b"\n",
                                     headers={"Content-Type": "application/x-ndjson"})
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = [json.loads(x) for x in r.read().decode().splitlines()]
        assert lines[-1]["summary"]["ok"] == 2, lines
        assert all(probabilities(x["body"]) == expected for x in lines if "index" in x), lines
        status, text = server.call("/v1/decisions", {"model": "clef-flash", "input": "word " * 4000,
                                                     "questions": QUESTIONS}, timeout=60)
        error = json.loads(text)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input", text
        status, text = server.call("/v1/decisions", {"model": "clef-flash", "questions": QUESTIONS, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]})
        assert status == 400 and json.loads(text)["error"]["param"] == "input[0].content[0]", text
        report["systemone"] = json.loads(server.call("/v1/systemone", SYSTEMONE, timeout=60)[1])
        report["ok"] = True
        print("OK: /v1/decisions on the vLLM backend answers the /v1/systemone probabilities", flush=True)
    finally:
        server.stop()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "openai_decisions_vllm.json").write_text(json.dumps(report, indent=1))
        (args.out / "openai_decisions_vllm_server.log").write_text(server.log()[-200_000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
