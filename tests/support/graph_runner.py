"""The head-graph runner on the CPU, for tests (tests/test_head_graphs.py, the pooler's in
tests/test_worker_pooler.py): every part of :class:`HeadGraphRunner` runs (buckets, capture-all,
self-checks, fill, replay, gather) except the CUDA graph itself, which a stand-in replaces."""

from __future__ import annotations

from clef_vllm.worker.fast.head_graphs import HeadGraphRunner, padded_probabilities


class CpuGraphRunner(HeadGraphRunner):
    """The runner on the CPU: a "graph" re-runs the body into the static output tensor it returned at
    capture (what a CUDA graph replay does), or, when ``broken`` (True, or a record bucket), writes what
    a graph reading a wrong buffer might (uniform probabilities)."""

    device_type = "cpu"

    def __init__(self, *args, broken: bool | int = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken = broken

    def _capture(self, *bucket):
        out = padded_probabilities(self.head, self._inputs, *bucket)
        runner = self

        class Graph:
            def replay(self):
                if runner.broken is True or runner.broken == bucket[0]:
                    out.fill_(0.5)
                else:
                    out.copy_(padded_probabilities(runner.head, runner._inputs, *bucket))

        return Graph(), out
