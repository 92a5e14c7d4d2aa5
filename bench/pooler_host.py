"""Host (Python) time the Clef pooler spends in vLLM's engine core per request, outside the GPU kernels:
a request's setup when its first chunk arrives (the head spec from the wire, its validation, the
token -> segment map) and, per step, the index data of the records the step finishes
(:func:`clef_vllm.model.features.step_indices`). Also the front end's share of a request's parameters: the
spec on the wire, vLLM's ``PoolingParams`` and the deep copy vLLM's input processing makes of them
(``PoolingParams.clone``). Short requests of clef-bench's ``short`` workload, encoded with the demo
checkpoint's tokenizer; median of 7 runs of 50. CPU only, no model (vLLM imported for its parameters).

    python bench/pooler_host.py > bench/results/cpu_pooler_host.txt
"""

from __future__ import annotations

import sys
import time


def median_ms(fn, number: int = 50, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t) * 1000 / number)
    return sorted(times)[runs // 2]


def main() -> int:
    from clef_vllm.bench.workloads import RequestFactory, build_variants
    from clef_vllm.model.demo import demo_checkpoint
    from clef_vllm.model.features import HeadSpec, RecordAccumulator, step_indices
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder

    encoder = RequestEncoder.from_pretrained(demo_checkpoint())
    factory = RequestFactory(encoder, seed=1)
    (short,) = build_variants(["short"])
    specs = [HeadSpec.from_encoded(encoder.encode(parse_request(factory.make(short, i).body))) for i in range(64)]
    wires = [spec.to_wire() for spec in specs]

    def setup(wire):
        spec = HeadSpec.from_wire(wire)
        spec.validate()
        RecordAccumulator(spec)

    per_request = median_ms(lambda: [setup(w) for w in wires]) / len(wires)
    from clef_vllm.backends.vllm_backend import pooling_params

    params_ms = median_ms(lambda: [pooling_params(s).clone() for s in specs]) / len(specs)
    print(f"short requests: {sum(s.num_tokens for s in specs) / len(specs):.0f} tokens, "
          f"{sum(s.num_fields for s in specs) / len(specs):.1f} fields, "
          f"{sum(s.num_options for s in specs) / len(specs):.1f} options, "
          f"{sum(len(s.lexical_ids) for s in specs) / len(specs):.0f} lexical tokens each (mean)")
    print(f"request setup (from_wire + validate + token segments): {per_request:.3f} ms per request")
    print(f"front end: the wire spec, PoolingParams and vLLM's deep copy of them: {params_ms:.3f} ms per request")
    print("records finishing in one step | step_indices ms | per record ms")
    for n in (1, 16, 40, 64):
        ms = median_ms(lambda n=n: step_indices(specs[:n]))
        print(f"{n:>29} | {ms:>15.3f} | {ms / n:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
