"""Measurement tools: ``clef-bench`` (load and throughput) and ``clef-parity`` (answer fidelity).

Both talk to any ``POST /v1/systemone`` endpoint (ours or another Clef server) and, for
comparison, to in-process engines: ``clef-bench --raw-vllm`` runs vLLM ``embed`` pooling of the
same token ids (the backbone alone, no head, no HTTP); ``clef-parity`` accepts offline backend
specs such as ``reference:DIR`` / ``vllm:DIR``. Importing this package needs neither torch nor vLLM.

Modules: :mod:`.workloads` (deterministic request sets with known token counts),
:mod:`.loadgen` (closed-loop async load and per-point statistics), :mod:`.raw_vllm` (the
raw-backbone baseline), :mod:`.targets` (HTTP and offline answerers for parity),
:mod:`.parity` (agreement, TV, KL, flips, receipts), :mod:`.report` (tables),
:mod:`.bench_cli` / :mod:`.parity_cli` (the console scripts).
"""

RESULT_SCHEMA_VERSION = 1
