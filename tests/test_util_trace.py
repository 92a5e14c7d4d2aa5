"""The request trace's marks inside vLLM (clef_vllm/util/trace.py): the model runner's input preparation, an
output where the engine core sends it and where the server decodes it. The pooler's own step marks are in
tests/test_worker_pooler.py, the profiler window in tests/test_backends_vllm.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")


def test_the_trace_marks_the_model_runners_input_preparation(tmp_path, monkeypatch, caplog):
    """``instrument_runner`` marks the start of vLLM's model-runner methods that prepare a step, in the order
    ``execute_model`` calls them; vLLM 0.28's runner has all of them; a second call wraps nothing twice;
    with tracing off it changes nothing."""
    import json

    from clef_vllm.util import trace
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class Runner(GPUModelRunner):        # a subclass: the wrappers land on it, vLLM's class stays as it is
        pass

    monkeypatch.setattr(trace, "PATH", None)
    assert trace.instrument_runner(Runner) == [] and "execute_model" not in vars(Runner)
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    methods = [m for _, m in trace.RUNNER_EVENTS]
    assert trace.instrument_runner(Runner) == methods and all(m in vars(Runner) for m in methods)
    wrapped = {m: vars(Runner)[m] for m in methods}
    assert trace.instrument_runner(Runner) == methods and {m: vars(Runner)[m] for m in methods} == wrapped

    class Stand:                          # a runner whose execute_model calls the others, as vLLM's does
        def execute_model(self, out):
            for m in methods[1:]:
                getattr(self, m)(out)
            return "done"

    for m in methods[1:]:
        setattr(Stand, m, lambda self, out, m=m: out.append(m))
    calls: list = []
    assert trace.instrument_runner(Stand) == methods
    assert Stand().execute_model(calls) == "done" and calls == methods[1:]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [(name, "*") for name, _ in trace.RUNNER_EVENTS]

    class Old:                            # a vLLM without one of the methods: skipped, said once
        def execute_model(self):
            return 1

    with caplog.at_level("WARNING", logger="clef_vllm"):
        assert trace.instrument_runner(Old) == ["execute_model"]
    assert "no _prepare_inputs" in caplog.text


def test_the_trace_marks_an_output_where_the_engine_core_sends_it_and_where_the_server_decodes_it(tmp_path,
                                                                                                 monkeypatch):
    """vLLM's msgpack encoder (the engine core's output thread) and decoder (AsyncLLM's output socket), wrapped
    once per process with tracing on, write ``engine_sent`` / ``client_decoded`` for each finished request
    of the outputs they carry, and nothing for unfinished ones or other messages."""
    import inspect
    import json

    from clef_vllm.util import trace
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    for cls, attr in ((MsgpackEncoder, "encode_into"), (MsgpackDecoder, "decode")):   # vLLM's own, restored after
        monkeypatch.setattr(cls, attr, inspect.unwrap(getattr(cls, attr)))
    monkeypatch.setattr(trace, "PATH", None)
    assert not trace.instrument_output("engine")                     # off: nothing wrapped
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    assert trace.instrument_output("engine") and trace.instrument_output("client")
    assert not trace.instrument_output("engine")                     # once per process
    outs = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="clef-1-aa-1234abcd", new_token_ids=[], pooling_output=torch.tensor([0.5, 0.5]),
                         finish_reason=FinishReason.STOP),
        EngineCoreOutput(request_id="clef-2-bb-99999999", new_token_ids=[])])
    frames = MsgpackEncoder().encode_into(outs, bytearray())
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert [o.request_id for o in back.outputs] == ["clef-1-aa-1234abcd", "clef-2-bb-99999999"]
    assert torch.equal(back.outputs[0].pooling_output, torch.tensor([0.5, 0.5]))
    MsgpackDecoder(dict).decode(MsgpackEncoder().encode({"not": "outputs"}))
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [("engine_sent", "clef-1-aa-1234abcd"),
                                                           ("client_decoded", "clef-1-aa-1234abcd")]
