"""Head graphs (clef_vllm/worker/fast/head_graphs.py): the padded graph body against the eager head.

The CUDA capture itself needs a GPU (tests/gpu/head_graphs.py); everything it replays is the
function tested here on the CPU: the padded batch built from the static buffers, with stale values
from earlier requests left in every padded row, slot and record.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clef_vllm.model.features import decide_group, decide_records
from clef_vllm.model.tables import DenseTable
from clef_vllm.testing.head_cases import SMALL, VOCAB, finished, random_head, random_record
from clef_vllm.worker.fast.head_graphs import (MEMORY_BUCKETS, SCHEMA_BUCKETS, SEVERAL_MEMORY_LIMIT, HeadGraphRunner,
                                          StaticInputs, choose_memory, choose_schema, graph_buckets,
                                          padded_probabilities, record_buckets, repeat_first_record)
from support.graph_runner import CpuGraphRunner


class Recorder:
    """Stands in for the runner: keeps the batch ``decide_records`` built, answers eagerly."""

    def __init__(self):
        self.batches = []

    def decide(self, batch):
        self.batches.append(batch)
        return None


def small_head_and_table():
    """A random small head (seeded) and a random lexical table drawn right after it."""
    head = random_head(SMALL)
    return head, DenseTable(torch.randn(VOCAB, SMALL.hidden_size))


def eager_and_batch(head, table, *records):
    """The eager head's probabilities of ``records`` decided in one batch (options concatenated) and the
    batch ``decide_group`` built for them (``decide_records`` may split records of very different lengths
    into several such batches)."""
    recorder = Recorder()
    probs = torch.cat(decide_group(head, table, finished(head, records), recorder))
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
    assert record_buckets(1) == (1,) and record_buckets(16) == (1, 2, 4, 8, 16) and record_buckets(5) == (1, 2, 4)
    # one record: every schema and memory bucket; several: the short decisions' buckets only
    memories = tuple(m for m in MEMORY_BUCKETS if m <= 16384)
    assert len(graph_buckets((1,), SCHEMA_BUCKETS, memories)) == 5 * 14
    several = graph_buckets((1, 2, 4, 8, 16), SCHEMA_BUCKETS, memories)
    assert len(several) == 5 * 14 + 4 * 3 * 8
    # 32 and 64 records: 1,024 and 512 rows per record at most, never more rows than 16 x 2,048 in all
    most = graph_buckets(record_buckets(64), SCHEMA_BUCKETS, memories)
    assert record_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and len(most) == len(several) + 3 * 6 + 3 * 4
    assert max(m for r, _, _, m in most if r == 32) == 1024 and max(m for r, _, _, m in most if r == 64) == 512
    assert max(r * m for r, _, _, m in several) == 16 * SEVERAL_MEMORY_LIMIT


def _stale_inputs(buckets, dtype):
    """Static buffers full of finite values from 'earlier requests'."""
    inputs = StaticInputs(SMALL.hidden_size, SMALL.width, buckets, dtype, "cpu")
    for buf in (inputs.memory, inputs.questions, inputs.contexts, inputs.lexical, inputs.last_state):
        buf.normal_(0, 3)
    inputs.type_ids.random_(0, 3)
    inputs.option_field.random_(0, 65)
    inputs.memory_lengths.random_(1, 500)
    inputs.field_lengths.random_(1, 60)
    return inputs


def _padded_and_eager(dtype, cases, seed=11, records=1):
    """Per group of ``records`` records finishing together (padded to a record bucket, stale finite
    values in every padded row, slot and record): the padded body's probabilities and the eager head's."""
    head = random_head(SMALL).to(dtype)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype))
    rng = random.Random(seed)
    runner = HeadGraphRunner(head, max_memory=512, max_records=64)     # its bucket choice, no graphs
    inputs = _stale_inputs(runner.buckets, dtype)
    out = []
    for k in range(0, len(cases), records):
        group = [random_record(rng, n_fields, length, SMALL.hidden_size) for n_fields, length in cases[k:k + records]]
        want, batch = eager_and_batch(head, table, *[(r[0].to(dtype), *r[1:]) for r in group])
        bucket = runner.choose(batch)
        real = inputs.fill(batch, *bucket)
        padded = inputs.batch(*bucket)
        # no attention over an empty key set, also in padded records (some kernels answer NaN there)
        assert not padded.memory_padding.all(1).any() and not padded.field_padding.all(1).any()
        got = padded_probabilities(head, inputs, *bucket)
        assert got.shape == (bucket[0] * bucket[2],) and torch.isfinite(got).all()
        out.append((got.index_select(0, real), want))
    return out


CASES = [(1, 20), (3, 75), (2, 41), (4, 120), (7, 300), (9, 200)]


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_padded_body_equals_the_eager_head(dtype, atol):
    """Padding is exact math: in float64 the padded body gives the eager head's probabilities to
    1e-12, in float32 to rounding."""
    for got, want in _padded_and_eager(dtype, CASES):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("records", [2, 3, 5, 20, 40])
def test_padded_body_of_several_records_equals_the_eager_head(records):
    """Several records finishing in one step, padded to a record bucket (2, 4, 8, 32, 64: a padded
    record's one unmasked row and field are stale values) and each to the bucket's fields, options and
    memory: float64 equals the eager head to 1e-12."""
    cases = [(1, 20), (3, 75), (2, 41), (4, 120), (7, 300), (9, 200), (2, 33), (5, 90), (1, 17), (6, 250)]
    cases = cases * -(-records // len(cases))
    for got, want in _padded_and_eager(torch.float64, cases, seed=records, records=records):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # records of one length: the eager batch has no memory padding at all (memory_padding is None)
    for got, want in _padded_and_eager(torch.float64, [(2, 300)] * records, seed=records, records=records):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


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
    head, table = small_head_and_table()
    record = random_record(random.Random(5), 3, 60, SMALL.hidden_size)
    want, batch = eager_and_batch(head, table, record)
    inputs = StaticInputs(SMALL.hidden_size, SMALL.width, [(1, 8, 32, 128)], torch.float32, "cpu")
    inputs.questions.normal_(0, 3)
    real = inputs.fill(batch, 1, 8, 32, 128)
    torch.testing.assert_close(padded_probabilities(head, inputs, 1, 8, 32, 128).index_select(0, real), want,
                               atol=2e-5, rtol=0)
    inputs.field_lengths[0].fill_(8)                # claim every field slot is real
    got = padded_probabilities(head, inputs, 1, 8, 32, 128)
    assert (got.index_select(0, real) - want).abs().max() > 1e-3


def test_runner_falls_back_without_a_graph():
    """Off CUDA, for more records than its largest record bucket, or beyond the largest buckets, the
    runner answers None (the caller runs the eager head) and counts why."""
    head, table = small_head_and_table()
    runner = HeadGraphRunner(head, max_memory=1000)
    assert runner.memory_buckets[-1] == 768
    rng = random.Random(3)
    one = random_record(rng, 2, 40, SMALL.hidden_size)
    accs = []
    for record in (one, random_record(rng, 2, 50, SMALL.hidden_size)):
        (acc,) = finished(head, [record])
        accs.append(acc)
    eager = decide_records(head, table, accs[:1])
    assert torch.equal(decide_records(head, table, accs[:1], runner)[0], eager[0])      # cpu: not_cuda
    decide_records(head, table, accs, runner)                                            # two records: eager
    long_ = random_record(rng, 1, 900, SMALL.hidden_size)
    (acc,) = finished(head, [long_])
    decide_records(head, table, [acc], runner)
    assert runner.describe() == {"graphs": 0, "replays": 0, "captures": 0, "failed": False,
                                 "fallbacks": {"not_cuda": 1, "records": 1, "memory": 1}}
    several = HeadGraphRunner(head, max_records=4)
    short, long_ = (random_record(rng, 2, n, SMALL.hidden_size) for n in (40, SEVERAL_MEMORY_LIMIT + 1))
    assert several.choose(eager_and_batch(head, table, short, short)[1]) == (2, 4, 16, 128)
    assert several.choose(eager_and_batch(head, table, *[short] * 5)[1]) == "records"
    assert several.choose(eager_and_batch(head, table, short, long_)[1]) == "memory"     # short decisions only
    assert several.choose(eager_and_batch(head, table, long_)[1]) == (1, 4, 16, 3072)
    most = HeadGraphRunner(head, max_records=64)
    assert most.choose(eager_and_batch(head, table, *[short] * 40)[1]) == (64, 4, 16, 128)
    mid = random_record(rng, 2, 1500, SMALL.hidden_size)
    assert most.choose(eager_and_batch(head, table, *[short] * 10, mid)[1]) == (16, 4, 16, 1536)
    assert most.choose(eager_and_batch(head, table, *[short] * 20, mid)[1]) == "memory"       # 1,024 rows at 32
    many = random_record(rng, 16, 60, SMALL.hidden_size)                                 # 16 fields
    assert several.choose(eager_and_batch(head, table, many, short)[1]) == "schema"
    assert several.choose(eager_and_batch(head, table, many)[1])[:3] == (1, 32, 128)


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
    """The class of bug a GPU run hit (``padding[...] = False`` copied a host scalar): the
    padded decision issues no op that creates a tensor from host data or reads a device value back.
    The op log is taken on the CPU; on a GPU each such op would synchronise (eager) or fail (capture)."""
    head, table = small_head_and_table()
    rng = random.Random(2)
    for group, bucket in (([random_record(rng, 3, 50, SMALL.hidden_size)], (1, 8, 32, 128)),
                          ([random_record(rng, n, 50 + 9 * n, SMALL.hidden_size) for n in (3, 1, 2)], (4, 8, 32, 128))):
        want, batch = eager_and_batch(head, table, *group)
        inputs = StaticInputs(SMALL.hidden_size, SMALL.width, [bucket], torch.float32, "cpu")
        with OpLog() as log:
            real = inputs.fill(batch, *bucket)          # between steps, outside the graph: no host sync either
        assert not [op for op in log.ops if op.startswith(HOST_SYNC_OPS)]
        with OpLog() as log:
            got = padded_probabilities(head, inputs, *bucket)
        assert len(log.ops) > 100
        assert not [op for op in log.ops if op.startswith(HOST_SYNC_OPS)]
        torch.testing.assert_close(got.index_select(0, real), want, atol=2e-5, rtol=0)
    # and the check sees the old mask: a Python scalar assigned through an index
    mask = torch.ones(1, 8, dtype=torch.bool)
    with OpLog() as log:
        mask[torch.zeros(3, dtype=torch.long), torch.arange(3)] = False
    assert [op for op in log.ops if op.startswith(HOST_SYNC_OPS)] == ["aten.lift_fresh.default"]


def test_the_runner_answers_every_decision_like_the_eager_head(caplog):
    """The whole runner on the CPU (every bucket captured at the first decision, the self-check, the
    fill, the replay, the slice): answers equal the eager head's, bucket after bucket, whatever ran before."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    head, table = small_head_and_table()
    runner = CpuGraphRunner(head, max_memory=512, schema_buckets=SCHEMA_BUCKETS[:3])
    rng = random.Random(4)
    cases = [random_record(rng, n, length, SMALL.hidden_size) for n, length in [(2, 40), (5, 300), (1, 20), (7, 130),
                                                                               (3, 500), (2, 40)]]
    for record in cases:
        (acc,) = finished(head, [record])
        want = decide_records(head, table, [acc])[0]
        got = decide_records(head, table, [acc], runner)[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    info = runner.describe()
    assert info["graphs"] == info["captures"] == 3 * 4 and not info["failed"]      # 3 schema x 4 memory buckets
    assert info["replays"] == len(cases) + 1                                     # + the self-check
    assert "graphs of 1 record(s) agree with the eager head" in caplog.text


def test_graphs_that_disagree_with_the_eager_head_are_never_used(caplog):
    head, table = small_head_and_table()
    runner = CpuGraphRunner(head, max_memory=512, schema_buckets=SCHEMA_BUCKETS[:2], broken=True)
    assert_eager_from_the_first_decision(head, table, runner, seed=6)
    assert "differs from the eager head" in caplog.text


def assert_eager_from_the_first_decision(head, table, runner, seed: int) -> None:
    """Two decisions of one record through ``runner`` answer exactly as the eager head, with no graph kept."""
    (acc,) = finished(head, [random_record(random.Random(seed), 3, 60, SMALL.hidden_size)])
    want = decide_records(head, table, [acc])[0]
    for _ in range(2):
        torch.testing.assert_close(decide_records(head, table, [acc], runner)[0], want, atol=0, rtol=0)
    info = runner.describe()
    assert info["failed"] and info["graphs"] == 0 and info["fallbacks"] == {"capture_failed": 2}


def test_a_capture_that_fails_leaves_the_eager_head_answering(caplog):
    """A capture that runs out of memory (the worker caps the allocator at the budget) gives up on every graph:
    the same decision, and every later one, is answered by the eager head (no self-check replays a graph that was
    never kept)."""
    head, table = small_head_and_table()

    class OutOfMemory(CpuGraphRunner):
        def _capture(self, *bucket):
            if bucket[3] >= 256:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")
            return super()._capture(*bucket)

    runner = OutOfMemory(head, max_memory=512, max_records=4, schema_buckets=SCHEMA_BUCKETS[:2])
    assert_eager_from_the_first_decision(head, table, runner, seed=8)
    assert "failed (OutOfMemoryError" in caplog.text and "runs eagerly from now on" in caplog.text


def test_the_runner_answers_steps_of_several_requests_like_the_eager_head(caplog):
    """Steps finishing 1-4 requests through one runner (record buckets 1, 2, 4): every answer equals the
    eager head's, every record bucket is checked once against the eager head at the first decision (a
    one-request step: on copies of its record), and a fifth request at once takes the eager head."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    head, table = small_head_and_table()
    runner = CpuGraphRunner(head, max_memory=512, max_records=4, schema_buckets=SCHEMA_BUCKETS[:3])
    rng = random.Random(8)
    steps = [[(2, 40)], [(5, 300), (1, 20)], [(3, 75), (2, 41), (7, 130)], [(1, 20), (4, 200), (2, 60), (3, 90)],
             [(2, 40)] * 5, [(6, 110), (2, 500)]]
    for i, step in enumerate(steps):
        accs = finished(head, [random_record(rng, n, length, SMALL.hidden_size) for n, length in step])
        want = decide_records(head, table, accs)
        got = decide_records(head, table, accs, runner)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
        if i == 0:      # the first step checked every record bucket: 1, 2 and 3 copies of its record
            assert runner.describe()["replays"] == 3 + 1 and runner._checked == {1, 2, 4}
    info = runner.describe()
    assert info["graphs"] == info["captures"] == 3 * 4 + 2 * 3 * 4 and not info["failed"]
    assert info["replays"] == 5 + 3                # five graphed steps + one self-check per record bucket
    assert info["fallbacks"] == {"records": 1}
    assert "graphs of 1, 2, 4 record(s) agree with the eager head" in caplog.text
    assert "the first decision of" not in caplog.text          # no request after the first was checked


def test_record_buckets_the_first_decision_cannot_fill_are_checked_at_their_own_first_decision(caplog):
    """A first decision too long for several-record graphs (memory past SEVERAL_MEMORY_LIMIT) checks the
    one-record graphs only; the two-record graphs are checked at the first two-request step."""
    caplog.set_level(logging.INFO, logger="clef_vllm")
    head, table = small_head_and_table()
    runner = CpuGraphRunner(head, max_memory=3072, max_records=2, schema_buckets=SCHEMA_BUCKETS[:1])
    rng = random.Random(10)
    for step in ([(2, SEVERAL_MEMORY_LIMIT + 1)], [(2, 40), (3, 50)]):
        accs = finished(head, [random_record(rng, n, length, SMALL.hidden_size) for n, length in step])
        for g, w in zip(decide_records(head, table, accs, runner), decide_records(head, table, accs), strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
    assert runner._checked == {1, 2} and runner.describe()["replays"] == 2 + 2
    assert "graphs of 1 record(s) agree" in caplog.text
    assert "the first decision of 2 record(s) agrees with the eager head" in caplog.text


def test_copies_of_the_first_record_are_that_record_decided_again():
    """``repeat_first_record``: whatever the batch's padding and record count, each copy is answered as
    its first record alone."""
    head = random_head(SMALL).to(torch.float64)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size, dtype=torch.float64))
    rng = random.Random(11)
    records = [(x.double(), *rest) for x, *rest in
               (random_record(rng, n, length, SMALL.hidden_size) for n, length in [(3, 40), (5, 90)])]
    alone, _ = eager_and_batch(head, table, records[0])
    _, batch = eager_and_batch(head, table, *records)
    assert batch.memory_padding is not None            # the first record is the shorter: padded rows
    copies = repeat_first_record(batch, 3)
    assert copies.layout.num_records == 3 and copies.memory.shape[:2] == (3, records[0][0].shape[0])
    torch.testing.assert_close(head.probabilities(head.decide(copies), copies.layout), alone.repeat(3),
                               atol=1e-12, rtol=0)


def test_a_record_bucket_whose_graphs_disagree_drops_every_graph(caplog):
    """One record's graphs agree; the two-record graphs read a wrong buffer: their check at the first
    decision drops every graph, and the eager head answers from then on (that first decision included)."""
    head, table = small_head_and_table()
    runner = CpuGraphRunner(head, max_memory=256, max_records=2, schema_buckets=SCHEMA_BUCKETS[:1], broken=2)
    rng = random.Random(9)
    one, two = finished(head, [random_record(rng, 2, 40, SMALL.hidden_size)]), finished(
        head, [random_record(rng, 2, 40, SMALL.hidden_size) for _ in range(2)])
    for accs in (one, two, one):
        for g, w in zip(decide_records(head, table, accs, runner), decide_records(head, table, accs), strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
    info = runner.describe()
    assert info["failed"] and info["graphs"] == 0 and info["fallbacks"] == {"capture_failed": 3}
    assert "a decision of 2 record(s) from a graph differs" in caplog.text
