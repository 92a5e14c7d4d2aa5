"""JointSchemaHead (docs/encoding-and-head.md): the vectorised head against a LITERAL loop implementation
of the head's forward pass (tests/support/release_math.py), which shares no code with ``clef_vllm.model.head``.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from clef_vllm.model.features import RecordAccumulator, accumulate, decide_records
from clef_vllm.model.head import HeadConfig, HeadConfigError, JointSchemaHead, count_parameters
from clef_vllm.model.release import RELEASE_HEAD_CONFIG
from clef_vllm.model.tables import DenseTable
from clef_vllm.testing.head_cases import SMALL, VOCAB, random_head, random_record, spec_of
from support.release_math import literal_logits

RELEASE = RELEASE_HEAD_CONFIG    # one home for the release head's dimensions (clef_vllm.model.release)


def vectorised(head, table, records, *, logits=True, chunk: int | None = None) -> list[torch.Tensor]:
    """The production path: accumulate hidden states (optionally in chunks), then decide_records."""
    accs = [RecordAccumulator(spec_of(*r)) for r in records]
    for acc, (X, _, _) in zip(accs, records):
        acc.spec.validate()
        step = chunk or X.shape[0]
        for start in range(0, X.shape[0], step):
            piece = X[start:start + step]
            accumulate(head, piece, [(acc, 0, piece.shape[0], start)])
    if logits:
        head.probabilities = lambda lg, layout: lg    # capture the logits instead of the softmax
    try:
        return decide_records(head, table, accs)
    finally:
        if logits:
            del head.probabilities


@pytest.fixture(scope="module")
def setup():
    head = random_head(SMALL)
    E = torch.randn(VOCAB, SMALL.hidden_size, generator=torch.Generator().manual_seed(3))
    rng = random.Random(7)
    records = [random_record(rng, n, length, SMALL.hidden_size)
               for n, length in [(1, 20), (3, 75), (2, 41), (4, 120), (1, 33)]]
    return head, E, records


def test_vectorised_head_equals_the_literal_loops_in_float32(setup):
    head, E, records = setup
    assert {len(r[2]) for r in records} == {1, 2, 3, 4}                     # field counts differ
    assert len({r[0].shape[0] for r in records}) == len(records)              # lengths differ
    got = vectorised(head, DenseTable(E), records)                           # one padded batch
    assert len(got) == len(records)
    for (X, ids, fields), logits in zip(records, got):
        want = torch.cat(literal_logits(head, X, ids, E, fields))
        assert logits.dtype == torch.float32 and logits.shape == want.shape
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_long_records_take_the_matmul_attention_and_still_equal_the_literal_loops(setup, monkeypatch):
    """A record longer than MATMUL_MIN_KEYS attends to its memory by two matmuls (the route a few queries
    over a long state take on the GPU); in float32 it still equals the literal implementation, alone and
    padded next to a short record."""
    from clef_vllm.model import head as head_module

    head, E, records = setup
    calls = []
    real = head_module.matmul_attention
    monkeypatch.setattr(head_module, "matmul_attention", lambda *a: calls.append(a[1].shape) or real(*a))
    long_ = random_record(random.Random(11), 3, head_module.MATMUL_MIN_KEYS + 37, SMALL.hidden_size)
    for batch in ([long_], [records[1], long_]):
        calls.clear()
        got = vectorised(head, DenseTable(E), batch)
        # every memory attention of the long batch: 2 evidence layers + 2 decoder layers
        assert len(calls) == SMALL.routing_layers + SMALL.layers
        assert all(shape[2] == head_module.MATMUL_MIN_KEYS + 37 for shape in calls)
        for (X, ids, fields), logits in zip(batch, got):
            torch.testing.assert_close(logits, torch.cat(literal_logits(head, X, ids, E, fields)), atol=1e-5, rtol=1e-5)
    calls.clear()
    vectorised(head, DenseTable(E), records)                 # short records: SDPA's fused kernel
    assert calls == []


def test_the_attention_route_is_chosen_by_shape():
    from clef_vllm.model.head import MATMUL_MAX_BYTES, MATMUL_MIN_KEYS, attention_route

    assert attention_route(1, 16, 16, 24576, 64) == "matmul"          # a 16k follow-up's option queries
    assert attention_route(1, 16, 4, 16384, 64) == "matmul"           # its field queries
    assert attention_route(1, 16, 16, MATMUL_MIN_KEYS - 1, 64) == "fused"   # a short state
    assert attention_route(8, 16, 16, 24576, 64) == "fused"           # 128 tiles: the fused kernel fills the GPU
    assert attention_route(7, 16, 16, 4096, 64) == "matmul"
    assert attention_route(1, 16, 256, 32768, 64) == "fused"          # its scratch would exceed the bound
    assert 16 * 32768 * (10 * 32 + 4 * 64) > MATMUL_MAX_BYTES
    assert attention_route(1, 16, 32, 32768, 64) == "fused"
    assert attention_route(1, 16, 16, 32768, 64) == "matmul"          # (4, 16) schemas at a 32k context
    assert attention_route(1, 16, 64, 16384, 64) == "matmul"          # up to (16, 64) at the default 16k
    assert attention_route(1, 16, 4, 8, 64) == "fused"                # the fields' self-attention


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matmul_attention_equals_sdpa_with_padding(dtype, tol):
    from clef_vllm.model.head import matmul_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g).to(dtype) for n in (5, 300, 300))
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[0, 200:] = True                                           # record 0 has 200 real keys
    keep = ~padding[:, None, None, :]
    got = matmul_attention(q, k, v, keep)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # padded keys are never read: changing them changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 200:], v2[0, :, 200:] = 1e3, -1e3
    assert torch.equal(matmul_attention(q, k2, v2, keep)[0], got[0])
    torch.testing.assert_close(matmul_attention(q, k, v, None).float(),
                               torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                               atol=tol, rtol=tol)


def test_chunked_accumulation_equals_one_pass(setup):
    head, E, records = setup
    whole = vectorised(head, DenseTable(E), records)
    chunked = vectorised(head, DenseTable(E), records, chunk=7)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_scalar_and_branch_matters(setup):
    """Sanity of the oracle comparison: changing any single part moves the logits."""
    head, E, records = setup
    base = torch.cat(vectorised(head, DenseTable(E), records[:2]))
    for name in ("prior_logit_scale", "residual_gate", "type_embedding.weight", "layers.1.norm2.bias",
                 "evidence_layers.1.memory_norm.weight", "residual_scorer.3.bias"):
        other = random_head(SMALL)
        with torch.no_grad():
            p = other.get_parameter(name)
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        moved = torch.cat(vectorised(other, DenseTable(E), records[:2]))
        assert not torch.allclose(base, moved, atol=1e-4), name
    # θ_j above ln 100 is clamped: 4.8 and 10 give the same logits
    clamped = random_head(SMALL, joint=10.0)
    torch.testing.assert_close(torch.cat(vectorised(clamped, DenseTable(E), records[:2])), base)


def test_probabilities_sum_to_one_per_question(setup):
    head, E, records = setup
    probs = vectorised(head, DenseTable(E), records, logits=False)
    for (_, _, fields), p in zip(records, probs):
        assert p.dtype == torch.float32 and bool((p >= 0).all())
        for part in p.split([len(o) for _, _, o in fields]):
            assert abs(float(part.sum()) - 1.0) < 1e-6
        # a one-option field is certain
        for (_, _, o), part in zip(fields, p.split([len(o) for _, _, o in fields])):
            if len(o) == 1:
                assert float(part[0]) == 1.0


def test_a_batch_equals_each_record_alone_in_bf16(setup):
    head, E, records = setup
    bf = random_head(SMALL).to(torch.bfloat16)
    table = DenseTable(E.to(torch.bfloat16))
    batched = vectorised(bf, table, records, logits=False)
    for record, p in zip(records, batched):
        alone = vectorised(bf, table, [record], logits=False)[0]
        torch.testing.assert_close(p, alone, atol=1e-2, rtol=0)
    # and bf16 stays close to the float32 head
    fp32 = vectorised(random_head(SMALL), DenseTable(E), records, logits=False)
    for a, b in zip(batched, fp32):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)


def test_padding_rows_do_not_leak_between_records(setup):
    """The same record next to a much longer one (padded memory) gives the same float32 logits."""
    head, E, records = setup
    short, long_ = records[0], records[3]
    alone = vectorised(head, DenseTable(E), [short])[0]
    for batch, i in (([short, long_], 0), ([long_, short], 1)):
        got = vectorised(head, DenseTable(E), batch)[i]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_padding_groups_bound_the_padded_rows():
    from clef_vllm.model.features import PADDED_ROWS_FLOOR, PADDING_FACTOR, padding_groups

    assert padding_groups([300] * 40) == [list(range(40))]                   # one length: one group
    assert padding_groups([40 + 3 * i for i in range(32)]) == [list(range(31, -1, -1))]   # similar: one group
    # a 16k-token record finishing beside 41 short ones: no longer 42 x 16,384 padded rows
    lengths = [400] * 20 + [16384] + [400] * 21
    groups = padding_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(42))
    assert groups[0][0] == 20 and len(groups) == 2
    for g in groups:
        padded, real = len(g) * max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert padded <= max(PADDED_ROWS_FLOOR, PADDING_FACTOR * real)
    assert padding_groups([]) == [] and padding_groups([7]) == [[0]]
    # seven 16k-token records finishing in one step: without a bound one group of 7 x 16,384 padded rows (the
    # head's keys alone 224 MiB at width 1,024); with --max-model-len as the bound, one record a group
    assert padding_groups([16384] * 7) == [list(range(7))]
    assert padding_groups([16384] * 7, max_rows=16384) == [[i] for i in range(7)]
    assert padding_groups([4000] * 8, max_rows=16384) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert padding_groups([20000, 10], max_rows=16384) == [[0], [1]]          # longer than the bound: alone


def test_records_of_very_different_lengths_are_decided_in_groups_with_the_same_answers(setup):
    """A long record beside many short ones: decide_records splits them (each GEMM of the head sees at most
    twice the real memory rows, or the floor) and every record's logits equal its logits alone."""
    from clef_vllm.model.features import PADDED_ROWS_FLOOR, PADDING_FACTOR
    from support.gemm_shapes import GemmShapes

    head, E, _ = setup
    rng = random.Random(11)
    short = [random_record(rng, 2, 60 + i, SMALL.hidden_size) for i in range(30)]
    long_ = random_record(rng, 1, 5000, SMALL.hidden_size)
    batch = short[:15] + [long_] + short[15:]
    with GemmShapes() as seen:
        got = vectorised(head, DenseTable(E), batch)
    real = sum(r[0].shape[0] for r in batch)
    assert max(rows for *_, rows in seen.seen) <= max(PADDED_ROWS_FLOOR, PADDING_FACTOR * real) < len(batch) * 5000
    for record, logits in zip(batch[14:17], got[14:17]):
        torch.testing.assert_close(logits, vectorised(head, DenseTable(E), [record])[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- names, shapes, counts


def spec_state_dict_shapes(H, D, Fw, routing, layers) -> dict[str, tuple]:
    """The release's head tensors, row by row (names and shapes of joint_head.safetensors)."""
    s = {"hidden_norm.weight": (H,), "hidden_norm.bias": (H,)}
    for p in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
        s[f"{p}_projection.weight"] = (D, H)
    s["type_embedding.weight"] = (3, D)

    def attn(prefix):
        return {f"{prefix}.in_proj_weight": (3 * D, D), f"{prefix}.in_proj_bias": (3 * D,),
                f"{prefix}.out_proj.weight": (D, D), f"{prefix}.out_proj.bias": (D,)}

    for r in range(routing):
        p = f"evidence_layers.{r}"
        for n in ("query_norm", "memory_norm", "feedforward_norm"):
            s[f"{p}.{n}.weight"] = s[f"{p}.{n}.bias"] = (D,)
        s.update(attn(f"{p}.attention"))
        s.update({f"{p}.feedforward.0.weight": (Fw, D), f"{p}.feedforward.0.bias": (Fw,),
                  f"{p}.feedforward.3.weight": (D, Fw), f"{p}.feedforward.3.bias": (D,)})
    s["option_summary_norm.weight"] = s["option_summary_norm.bias"] = (D,)
    for layer_index in range(layers):
        p = f"layers.{layer_index}"
        s.update(attn(f"{p}.self_attn"))
        s.update(attn(f"{p}.multihead_attn"))
        s.update({f"{p}.linear1.weight": (Fw, D), f"{p}.linear1.bias": (Fw,),
                  f"{p}.linear2.weight": (D, Fw), f"{p}.linear2.bias": (D,)})
        for n in ("norm1", "norm2", "norm3"):
            s[f"{p}.{n}.weight"] = s[f"{p}.{n}.bias"] = (D,)
    for n in ("field_norm", "option_norm"):
        s[f"{n}.weight"] = s[f"{n}.bias"] = (D,)
    s.update({"residual_scorer.0.weight": (D, 4 * D), "residual_scorer.0.bias": (D,),
              "residual_scorer.3.weight": (1, D), "residual_scorer.3.bias": (1,)})
    s.update({"prior_logit_scale": (), "joint_logit_scale": (), "residual_gate": ()})
    return s


def test_release_state_dict_names_shapes_and_parameter_count():
    with torch.device("meta"):
        head = JointSchemaHead(RELEASE)
    sd = head.state_dict()
    expected = spec_state_dict_shapes(4096, 1024, 4096, 2, 4)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert len(sd) == 122
    assert sum(v.numel() for v in sd.values()) == 121_762_820
    assert sum(p.numel() for p in head.parameters()) == 121_762_820
    assert count_parameters(RELEASE) == 121_762_820
    assert not list(head.buffers())                                           # nothing hidden outside the file


def test_parameter_count_of_the_27b_head_and_others():
    big = HeadConfig(hidden_size=5120, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
    assert count_parameters(big) == 128_056_324
    for cfg in (big, SMALL, HeadConfig(hidden_size=64, width=48, routing_layers=0, layers=3, heads=6, feedforward=80)):
        with torch.device("meta"):
            n = sum(p.numel() for p in JointSchemaHead(cfg).parameters())
        assert count_parameters(cfg) == n


def test_strict_loading_of_a_joint_head_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    src = random_head(SMALL).to(torch.bfloat16)
    path = tmp_path / "joint_head.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path), metadata={"format": "pt"})
    state = load_file(str(path))
    assert set(state) == set(spec_state_dict_shapes(48, 32, 64, 2, 2))
    dst = JointSchemaHead(SMALL)
    dst.load_state_dict(state, strict=True)
    for k, v in dst.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), state[k])
    with pytest.raises(RuntimeError, match="Unexpected key"):
        JointSchemaHead(SMALL).load_state_dict({**state, "extra.weight": torch.zeros(1)}, strict=True)
    missing = dict(state)
    del missing["residual_gate"]
    with pytest.raises(RuntimeError, match="Missing key"):
        JointSchemaHead(SMALL).load_state_dict(missing, strict=True)


# --------------------------------------------------------------------------- HeadConfig


RELEASE_JSON = {"hidden_size": 4096, "width": 1024, "routing_layers": 2, "layers": 4, "heads": 16, "feedforward": 4096}


def test_head_config_parses_the_release_file():
    cfg = HeadConfig.from_dict(dict(RELEASE_JSON))
    assert cfg == RELEASE and cfg.dropout == 0.0 and cfg.requires_clef_vllm is None
    # the repository's own clef_head/joint_head_config.json (the model repo's file) is the release head too
    shipped = Path(__file__).resolve().parents[1] / "clef_head" / "joint_head_config.json"
    assert dataclasses.replace(HeadConfig.from_dict(json.loads(shipped.read_text())), requires_clef_vllm=None) == RELEASE
    assert cfg.to_dict() == RELEASE_JSON
    marked = HeadConfig.from_dict(RELEASE_JSON | {"requires_clef_vllm": ">=0.1", "dropout": 0.1})
    assert marked.requires_clef_vllm == ">=0.1" and marked.dropout == 0.1
    assert HeadConfig.from_dict(marked.to_dict()) == marked


@pytest.mark.parametrize("change, message", [
    ({"ff": 4096}, r"unknown key\(s\) \['ff'\]"),
    ({"temperature": 1.0}, r"unknown key\(s\) \['temperature'\]"),
    ({"feedforward": -1}, "feedforward must be a positive integer"),
    ({"routing_layers": -1}, "routing_layers must be a positive integer"),
    ({"width": 64.0}, "width must be a positive integer"),
    ({"width": 1000}, "width 1000 is not divisible by heads 16"),
    ({"heads": 0}, "heads must be a positive integer"),
    ({"hidden_size": "4096"}, "hidden_size must be a positive integer"),
    ({"layers": True}, "layers must be a positive integer"),
    ({"requires_clef_vllm": 1}, "requires_clef_vllm must be a PEP 440 specifier string"),
])
def test_head_config_refuses_bad_files(change, message):
    with pytest.raises(HeadConfigError, match=message):
        HeadConfig.from_dict(RELEASE_JSON | change, source="cfg.json")


@pytest.mark.parametrize("key", sorted(RELEASE_JSON))
def test_head_config_missing_key_is_named(key):
    data = dict(RELEASE_JSON)
    del data[key]
    with pytest.raises(HeadConfigError, match=rf"some/joint_head_config.json: missing key\(s\) \['{key}'\]"):
        HeadConfig.from_dict(data, source="some/joint_head_config.json")


def test_head_config_must_be_an_object():
    with pytest.raises(HeadConfigError, match="expected a JSON object"):
        HeadConfig.from_dict([RELEASE_JSON])


def test_zero_routing_or_decoder_layers_are_allowed():
    HeadConfig.from_dict(RELEASE_JSON | {"routing_layers": 0, "layers": 0})


# --------------------------------------------------------------------------- end to end on the tiny checkpoint


@pytest.fixture(scope="module")
def clef(tiny_release, cache_dir):
    from clef_vllm import Clef

    with Clef(tiny_release, backend="reference") as c:
        yield c


def test_request_order_of_choice_keys_does_not_change_answers(clef):
    crit = {"technical": "Outages and errors", "billing": "Payments", "sales": "Plans", "legal": None,
            "Accounts": "Logins"}
    base = {"model": "m", "state": "Checkout has been failing for every customer for an hour.",
            "questions": {"team": {"type": "choice", "instructions": "Which team?", "criteria": crit},
                          "urgent": {"type": "noul", "instructions": "Urgent?"}}}
    answers = []
    rng = random.Random(0)
    for _ in range(4):
        items = list(crit.items())
        rng.shuffle(items)
        req = {**base, "questions": {**base["questions"], "team": {**base["questions"]["team"],
                                                                   "criteria": dict(items)}}}
        out = clef.systemone(req)
        team = out["answers"]["team"]
        assert list(team["probabilities"]) == [k for k, _ in items]          # keys in request order
        answers.append((team["choice"], team["confidence"], dict(sorted(team["probabilities"].items())),
                        out["answers"]["urgent"], out["usage"]))
    assert all(a == answers[0] for a in answers)


def test_head_work_per_step_does_not_grow_with_the_number_of_records():
    """Inside vLLM every tensor op is a kernel launch on the step's critical path: one step's
    accumulate + decide_records must issue the same ops for 4 records as for 32 (no per-record
    slicing, copies or uploads), with different lengths (padded memory) in both."""
    from clef_vllm.bench.head_ops import count      # what python -m clef_vllm.bench.head_ops reports

    head = random_head(SMALL)
    table = DenseTable(torch.randn(VOCAB, SMALL.hidden_size))

    def ops(batch: int) -> int:
        return count(head, table, [40 + 3 * i for i in range(batch)])["tensor_ops"]

    assert ops(4) == ops(32)


def test_span_sums_take_only_span_rows_across_chunks_and_offsets():
    """One step's rows for several records (at offsets, with a row no record owns between them), each record in
    two chunks: the fp32 sums of every question and option span equal a direct sum of its normalised rows, and
    the overflow row (tokens outside every span) is never summed."""
    torch.manual_seed(3)
    head = random_head(SMALL).double()
    records = [random_record(random.Random(seed), n, 60 + 9 * n, SMALL.hidden_size) for seed, n in ((1, 2), (2, 3), (5, 1))]
    specs = [spec_of(*r) for r in records]
    hiddens = [r[0].double() for r in records]
    accs = [RecordAccumulator(s) for s in specs]
    cut = [s.num_tokens // 2 for s in specs]
    for part in (0, 1):
        rows, pieces, offset = [], [], 0
        for acc, x, c in zip(accs, hiddens, cut):
            start, end = (0, c) if part == 0 else (c, x.shape[0])
            rows += [x[start:end], torch.randn(1, x.shape[1], dtype=x.dtype)]     # a row no record owns
            pieces.append((acc, offset, end - start, start))
            offset += end - start + 1
        accumulate(head, torch.cat(rows), pieces)
    for acc, x in zip(accs, hiddens):
        states = head.hidden_norm(x).float()
        want = torch.stack([states[a:b].sum(0) for a, b in acc.spec.spans()])
        torch.testing.assert_close(acc.sums[:acc.spec.num_segments], want, rtol=1e-6, atol=1e-6)
        assert not acc.sums[acc.spec.num_segments].any()
        assert acc.complete and torch.equal(acc.last_state, head.hidden_norm(x)[-1])
