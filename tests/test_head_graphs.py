"""Head graphs (clef_vllm/worker/head_graphs.py): the padded graph body against the eager head.

The CUDA capture itself needs a GPU (tests/gpu/head_graphs.py); everything it replays is the
function tested here on the CPU: the padded batch built from the static buffers, with stale values
from earlier requests left in every padded row.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clef_vllm.features import RecordAccumulator, accumulate, decide_records
from clef_vllm.tables import DenseTable
from clef_vllm.worker.head_graphs import (MEMORY_BUCKETS, SCHEMA_BUCKETS, HeadGraphRunner, StaticInputs,
                                          choose_memory, choose_schema, padded_probabilities)
from clef_vllm.testing.head_cases import SMALL, VOCAB, random_head, random_record, spec_of


class Recorder:
    """Stands in for the runner: keeps the single-record batch ``decide_records`` built, answers eagerly."""

    def __init__(self):
        self.batches = []

    def decide(self, batch):
        self.batches.append(batch)
        return None


def eager_and_batch(head, table, record):
    acc = RecordAccumulator(spec_of(*record))
    accumulate(head, record[0], [(acc, 0, record[0].shape[0], 0)])
    recorder = Recorder()
    probs = decide_records(head, table, [acc], recorder)[0]
    (batch,) = recorder.batches
    return probs, batch


def test_bucket_choice():
    assert choose_schema(3, 9) == (4, 16)
    assert choose_schema(4, 9) == (8, 32)            # a field slot always stays free for the padded options
    assert choose_schema(3, 17) == (8, 32)
    assert choose_schema(64, 256) == (65, 256)
    assert choose_schema(65, 10) is None and choose_schema(2, 257) is None
    assert choose_memory(400) == 512 and choose_memory(128) == 128 and choose_memory(129) == 256
    assert choose_memory(MEMORY_BUCKETS[-1] + 1) is None
    assert all(f > 1 for f, _ in SCHEMA_BUCKETS)


def _padded_and_eager(dtype, cases, seed=11):
    """Per record (alone in its bucket, stale finite values from 'earlier requests' in every padded
    row and slot): the padded body's probabilities and the eager head's."""
    head = random_head(SMALL).to(dtype)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype))
    rng = random.Random(seed)
    inputs = StaticInputs(SMALL.hidden_size, SMALL.width, 65, 256, 512, dtype, "cpu")
    for buf in (inputs.memory, inputs.questions, inputs.contexts, inputs.lexical, inputs.last_state):
        buf.normal_(0, 3)
    inputs.type_ids.random_(0, 3)
    inputs.option_field.random_(0, 65)
    out = []
    for n_fields, length in cases:
        record = random_record(rng, n_fields, length, SMALL.hidden_size)
        want, batch = eager_and_batch(head, table, (record[0].to(dtype), *record[1:]))
        fields, options = choose_schema(n_fields, len(want))
        inputs.fill(batch, fields, options)
        got = padded_probabilities(head, inputs, fields, options, choose_memory(record[0].shape[0]))
        assert got.shape == (options,) and torch.isfinite(got).all()
        out.append((got[:len(want)], want))
    return out


CASES = [(1, 20), (3, 75), (2, 41), (4, 120), (7, 300), (9, 200)]


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_padded_body_equals_the_eager_head(dtype, atol):
    """Padding is exact math: in float64 the padded body gives the eager head's probabilities to
    1e-12, in float32 to rounding."""
    for got, want in _padded_and_eager(dtype, CASES):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_padded_body_adds_no_error_in_bf16():
    """In bf16 the padded kernels' shapes round differently: measured against the float64 answer, the
    padded body stays within twice the eager head's own bf16 error on these records (its noise floor;
    this random head's logit scale of 100 magnifies it to a few 0.01)."""
    exact = [want.double() for _, want in _padded_and_eager(torch.float64, CASES)]
    pairs = _padded_and_eager(torch.bfloat16, CASES)
    floor = max((want.double() - ref).abs().max().item() for (_, want), ref in zip(pairs, exact))
    assert 0 < floor < 0.05
    for (got, _), ref in zip(pairs, exact):
        assert (got.double() - ref).abs().max().item() <= 2 * floor


def test_the_spare_field_is_masked():
    """Without the field mask the padded field slots would take part in the fields' self-attention:
    the test above would fail. Checked directly: unmasked padding changes a real field's answer."""
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    record = random_record(random.Random(5), 3, 60, SMALL.hidden_size)
    want, batch = eager_and_batch(head, table, record)
    inputs = StaticInputs(SMALL.hidden_size, SMALL.width, 8, 32, 128, torch.float32, "cpu")
    inputs.questions.normal_(0, 3)
    inputs.fill(batch, 8, 32)
    inputs.lengths[1].fill_(8)                      # claim every field slot is real
    got = padded_probabilities(head, inputs, 8, 32, 128)
    assert (got[:len(want)] - want).abs().max() > 1e-3


def test_runner_falls_back_without_a_graph():
    """Off CUDA, for several records, or beyond the largest buckets, the runner answers None (the
    caller runs the eager head) and counts why."""
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    runner = HeadGraphRunner(head, max_memory=1000)
    assert runner.memory_buckets[-1] == 768
    rng = random.Random(3)
    one = random_record(rng, 2, 40, SMALL.hidden_size)
    accs = []
    for record in (one, random_record(rng, 2, 50, SMALL.hidden_size)):
        acc = RecordAccumulator(spec_of(*record))
        accumulate(head, record[0], [(acc, 0, record[0].shape[0], 0)])
        accs.append(acc)
    eager = decide_records(head, table, accs[:1])
    assert torch.equal(decide_records(head, table, accs[:1], runner)[0], eager[0])      # cpu: not_cuda
    decide_records(head, table, accs, runner)                                            # two records: eager
    long_ = random_record(rng, 1, 900, SMALL.hidden_size)
    acc = RecordAccumulator(spec_of(*long_))
    accumulate(head, long_[0], [(acc, 0, long_[0].shape[0], 0)])
    decide_records(head, table, [acc], runner)
    assert runner.describe() == {"graphs": 0, "replays": 0, "captures": 0, "failed": False,
                                 "fallbacks": {"not_cuda": 1, "memory": 1}}


#: Ops that, on a GPU, copy host data to the device or wait for the device: each synchronises the host
#: with the stream (and cannot be captured in a graph).
HOST_SYNC_OPS = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero",
                 "aten.masked_select", "aten._unique", "aten.unique")


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_graph_body_never_touches_host_data():
    """The class of the bug the first GPU round hit (``padding[...] = False`` copied a host scalar): the
    padded decision issues no op that creates a tensor from host data or reads a device value back.
    The op log is taken on the CPU; on a GPU each such op would synchronise (eager) or fail (capture)."""
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    want, batch = eager_and_batch(head, table, random_record(random.Random(2), 3, 50, SMALL.hidden_size))
    inputs = StaticInputs(SMALL.hidden_size, SMALL.width, 8, 32, 128, torch.float32, "cpu")
    inputs.fill(batch, 8, 32)
    with OpLog() as log:
        padded_probabilities(head, inputs, 8, 32, 128)
    assert len(log.ops) > 100
    assert not [op for op in log.ops if op.startswith(HOST_SYNC_OPS)]
    # and the check sees the old mask: a Python scalar assigned through an index
    mask = torch.ones(1, 8, dtype=torch.bool)
    with OpLog() as log:
        mask[torch.zeros(3, dtype=torch.long), torch.arange(3)] = False
    assert [op for op in log.ops if op.startswith(HOST_SYNC_OPS)] == ["aten.lift_fresh.default"]


class CpuGraphRunner(HeadGraphRunner):
    """The runner on the CPU: a "graph" re-runs the body into the static output tensor it returned at
    capture (what a CUDA graph replay does), or, with ``broken``, writes what a graph reading a wrong
    buffer might (uniform probabilities)."""

    device_type = "cpu"

    def __init__(self, *args, broken: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken = broken

    def _capture(self, fields_, options, memory):
        out = padded_probabilities(self.head, self._inputs, fields_, options, memory)
        runner = self

        class Graph:
            def replay(self):
                if runner.broken:
                    out.fill_(0.5)
                else:
                    out.copy_(padded_probabilities(runner.head, runner._inputs, fields_, options, memory))

        return Graph(), out


def test_the_runner_answers_every_decision_like_the_eager_head(caplog):
    """The whole runner on the CPU (every bucket captured at the first decision, the self-check, the
    fill, the replay, the slice): answers equal the eager head's, bucket after bucket, whatever ran before."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    runner = CpuGraphRunner(head, max_memory=512, schema_buckets=SCHEMA_BUCKETS[:3])
    rng = random.Random(4)
    cases = [random_record(rng, n, length, SMALL.hidden_size) for n, length in [(2, 40), (5, 300), (1, 20), (7, 130),
                                                                               (3, 500), (2, 40)]]
    for record in cases:
        acc = RecordAccumulator(spec_of(*record))
        accumulate(head, record[0], [(acc, 0, record[0].shape[0], 0)])
        want = decide_records(head, table, [acc])[0]
        got = decide_records(head, table, [acc], runner)[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    info = runner.describe()
    assert info["graphs"] == info["captures"] == 3 * 4 and not info["failed"]      # 3 schema x 4 memory buckets
    assert info["replays"] == len(cases) + 1                                     # + the self-check
    assert "agrees with the eager head" in caplog.text


def test_graphs_that_disagree_with_the_eager_head_are_never_used(caplog):
    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))
    runner = CpuGraphRunner(head, max_memory=512, schema_buckets=SCHEMA_BUCKETS[:2], broken=True)
    record = random_record(random.Random(6), 3, 60, SMALL.hidden_size)
    acc = RecordAccumulator(spec_of(*record))
    accumulate(head, record[0], [(acc, 0, record[0].shape[0], 0)])
    want = decide_records(head, table, [acc])[0]
    for _ in range(2):
        torch.testing.assert_close(decide_records(head, table, [acc], runner)[0], want, atol=0, rtol=0)
    info = runner.describe()
    assert info["failed"] and info["graphs"] == 0 and info["fallbacks"] == {"capture_failed": 2}
    assert "differs from the eager head" in caplog.text
