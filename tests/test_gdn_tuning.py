"""``--gdn-tuning`` (clef_vllm/worker/fast/gdn_tuning.py): the GDN kernels' autotuners keep one tuning per shape class.

Triton's kernels do not run on the CI machine, so the autotuner here is a stand-in with the interface the
module uses (``arg_names``, ``cache``, ``run``; a key from its arguments without the token count, as the
flash-linear-attention kernels' keys are) and the real option plumbing; the GPU run is
``bench/results/h200_gdn_configs.json`` and the server's own start-up (docs/latency.md, "GDN kernel tuning").
"""

from __future__ import annotations

import logging

import pytest
import torch

from clef_vllm.worker.fast import gdn_tuning
from clef_vllm.worker.fast.gdn_tuning import ClassedTuner, call_shape, shape_class, tuning_shapes


class StandInTuner:
    """An autotuner whose key leaves out ``T`` (as the GDN kernels' do): a new key is 'tuned' to the token count
    of the call that first met it."""

    arg_names = ("k", "cu_seqlens", "T", "H")

    def __init__(self):
        self.cache: dict = {}
        self.tunings = 0

    def run(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args)) | kwargs
        key = (named["H"],)
        if key not in self.cache:
            self.cache[key] = f"best at T={named['T']}"
            self.tunings += 1
        return self.cache[key]


@pytest.fixture
def fresh_stats(monkeypatch):
    monkeypatch.setattr(gdn_tuning, "STATS", gdn_tuning.Counter())
    monkeypatch.setattr(gdn_tuning, "TUNERS", {})


def cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_shape_classes():
    assert shape_class(1, 1) == shape_class(1, gdn_tuning.SHORT_TOKENS) == "one"
    assert shape_class(1, gdn_tuning.SHORT_TOKENS + 1) == shape_class(1, 16384) == "one-long"
    assert shape_class(2, 20) == shape_class(41, 16031) == "several"


def test_tuning_shapes_fit_the_steps_the_server_can_run():
    assert tuning_shapes(16384, 16384) == [("one", 1, 448), ("one-long", 1, 4096), ("several", 40, 400)]
    for budget, max_len in ((16384, 16384), (8192, 2048), (2048, 300), (512, 512), (512, 4096), (64, 64)):
        shapes = tuning_shapes(budget, max_len)
        assert [c for c, *_ in shapes] == [c for c in gdn_tuning.CLASSES if c in {c for c, *_ in shapes}]
        for cls, sequences, each in shapes:
            assert sequences * each <= budget and each <= max_len, (budget, max_len, cls)
            assert shape_class(sequences, sequences * each) == cls       # each shape is in the class it tunes
    # no long sequence fits: no one-long class; a step of two sequences of 256
    assert tuning_shapes(512, 512) == [("one", 1, 448), ("several", 2, 256)]
    assert [c for c, *_ in tuning_shapes(16384, 900)] == ["one", "several"]


def test_call_shape_reads_host_side_sizes_only():
    names = StandInTuner.arg_names
    assert call_shape(names, (None, cu(400, 391), 791), {"H": 32}) == (2, 791)
    assert call_shape(names, (), {"k": None, "cu_seqlens": cu(4096), "T": 4096}) == (1, 4096)
    assert call_shape(names, (None, None, 64), {}) == (1, 64)                 # no cu_seqlens: one sequence


def test_each_class_keeps_its_own_tuning(fresh_stats, caplog):
    tuner = StandInTuner()
    tuner.cache[(32,)] = "vLLM's 64-token choice"                 # vLLM's warm-up ran before the install
    assert gdn_tuning.install({"kernel_h": tuner}) == 1
    assert gdn_tuning.install({"kernel_h": tuner}) == 0          # idempotent
    wrapper = gdn_tuning.TUNERS["kernel_h"]
    assert tuner.run == wrapper.run
    assert tuner.cache_results is False          # Triton's disk cache (vLLM turns it on) knows no classes

    # the start-up tuning: each class tuned at its own step (vLLM's choice for one sequence replaced)
    wrapper.tuning_now = True
    for cls, sequences, each in tuning_shapes(16384, 16384):
        wrapper.forget(cls)
        tuner.run(None, cu(*[each] * sequences), sequences * each, 32)
    wrapper.tuning_now = False
    assert gdn_tuning.STATS["tuned"] == 3 and gdn_tuning.STATS["late"] == 0
    assert {k: v[(32,)] for k, v in wrapper.caches.items()} == {
        "one": "best at T=448", "one-long": "best at T=4096", "several": "best at T=16000"}

    # calls pick their class's tuning; nothing is tuned again
    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        assert tuner.run(None, cu(400), 400, H=32) == "best at T=448"
        assert tuner.run(None, cu(16384), 16384, H=32) == "best at T=4096"
        assert tuner.run(None, cu(391, 400, 390), 1181, H=32) == "best at T=16000"
        assert tuner.tunings == 3 and "autotuned at its first call" not in caplog.text
        # a key no tuning covered is tuned at its first call, and said
        assert tuner.run(None, cu(391, 400), 791, H=16) == "best at T=791"
    assert gdn_tuning.STATS["late"] == 1 and gdn_tuning.STATS["late kernel_h/several"] == 1
    assert "kernel_h autotuned at its first call in class several (2 sequence(s), 791 tokens)" in caplog.text
    assert gdn_tuning.describe() == ("3 kernel tunings at start-up, 1 at a first call later "
                                     "(kernel_h/several x1)")
    assert wrapper.chosen() == {"one": "best at T=448", "one-long": "best at T=4096", "several": "best at T=16000"}


def test_fast_benchmark_only_while_tuning(fresh_stats):
    pytest.importorskip("triton.testing")
    tuner = StandInTuner()
    gdn_tuning.install({"k": tuner})
    with gdn_tuning._fast_bench():
        bench = tuner.__dict__["do_bench"]
        assert bench.keywords == {"warmup": gdn_tuning.BENCH_WARMUP_MS, "rep": gdn_tuning.BENCH_REP_MS}
        assert gdn_tuning.TUNERS["k"].tuning_now
    assert "do_bench" not in tuner.__dict__ and not gdn_tuning.TUNERS["k"].tuning_now


def test_wrapper_forgets_one_class_only(fresh_stats):
    tuner = StandInTuner()
    wrapper = ClassedTuner(tuner, "k")
    wrapper.caches.update({"several": {(32,): "x"}, "one-long": {(32,): "y"}})
    wrapper.forget("several")
    assert wrapper.caches["several"] == {} and wrapper.caches["one-long"] == {(32,): "y"}


def test_tune_needs_a_gdn_layer(fresh_stats):
    pytest.importorskip("vllm")
    gdn_tuning.install({"k": StandInTuner()})
    assert gdn_tuning.tune(torch.nn.Linear(2, 2), 16384, 16384, torch.bfloat16, "cpu") == {}


def test_gdn_features_are_off_where_the_gdn_prefill_is_not_triton(fresh_stats, monkeypatch, caplog):
    """FlashInfer's GDN prefill (--gdn-prefill-backend flashinfer): neither the tuning nor the prefill graphs
    install, and the log says why."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from clef_vllm.contract import PrefillGraphs, WorkerSettings
    from clef_vllm.worker.fast.prefill_graphs import triton_gdn
    from clef_vllm.worker.model import ClefFlashForDecision

    class StandInLayer(QwenGatedDeltaNetAttention):
        def __init__(self, backend):
            torch.nn.Module.__init__(self)
            self.gdn_prefill_backend = backend

    installed = []
    monkeypatch.setattr(gdn_tuning, "install", lambda *a: installed.append(a))
    fi = torch.nn.Sequential(StandInLayer("flashinfer"), StandInLayer("flashinfer"))
    worker = SimpleNamespace(model=fi, _on_gpu=lambda wanted, label: wanted)     # as on a CUDA device
    settings = WorkerSettings(gdn_tuning=True, prefill_graphs=PrefillGraphs((64,), "core"))
    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        assert ClefFlashForDecision._install_gdn_tuning(worker, None, settings) is None
        assert ClefFlashForDecision._install_prefill_graphs(worker, None, settings) is None
    assert not installed
    for label in ("GDN tuning", "prefill graphs"):
        assert f"clef {label}: off: the GDN prefill runs on flashinfer" in caplog.text
    assert triton_gdn(torch.nn.Sequential(StandInLayer("triton")), "x")
    assert triton_gdn(torch.nn.Linear(2, 2), "x")          # no GDN layer: nothing to refuse


def test_the_worker_tunes_once_at_its_first_forward_and_a_failure_only_warns(fresh_stats, monkeypatch, caplog):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from clef_vllm.worker.model import ClefFlashForDecision

    cuda = SimpleNamespace(type="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls = []
    monkeypatch.setattr(gdn_tuning, "tune", lambda *a: calls.append(a) or {
        "several": {"sequences": 40, "tokens_each": 400, "seconds": 1.0}})
    worker = SimpleNamespace(_gdn_tuning=(16384, 16384, torch.bfloat16), model="backbone")
    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        ClefFlashForDecision._tune_gdn(worker, SimpleNamespace(type="cpu"))     # not on a GPU: later
        assert worker._gdn_tuning is not None and not calls
        ClefFlashForDecision._tune_gdn(worker, cuda)
    assert worker._gdn_tuning is None and calls == [("backbone", 16384, 16384, torch.bfloat16, cuda)]
    assert "clef GDN tuning: several at 40 x 400 tokens in" in caplog.text

    def broken(*a):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gdn_tuning, "tune", broken)
    worker._gdn_tuning = (16384, 16384, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        ClefFlashForDecision._tune_gdn(worker, cuda)
    assert worker._gdn_tuning is None
    assert "clef GDN tuning failed (RuntimeError: out of resources)" in caplog.text
