#!/usr/bin/env bash
# Hybrid quality on a trained Clef-architecture proxy, on the GPU machine (H200: torch 2.11,
# transformers 5.17, no network). vLLM 0.28 must be staged onto the GPU machine first (vLLM +
# compressed-tensors 0.17 in /root/site, see tests/gpu/env.sh). Needs nothing carried: the
# data are synthetic build_data records made in the call, unless DATA=path/to/build_data/folder
# is carried (e.g. carry=[".bench/data"] after `clef-build-data --out .bench/data`).
#
# One call (about 9 minutes; TRAIN_SECONDS trims training):
#   run(command="bash bench/quality_gpu.sh", timeout_s=600)
# Two calls on the same warm machine (safer; the checkpoints stay in $WORK between them):
#   run(command="STAGES=train,build,scan,simulate bash bench/quality_gpu.sh", timeout_s=600)
#   run(command="STAGES=vllm bash bench/quality_gpu.sh", timeout_s=600)
# Results: $OUT/quality.{json,md} (cumulative over calls: also kept in $WORK), $OUT/sensitivity_scan.{json,png}, $OUT/vllm-*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# staged vLLM + this tree's plugin on PYTHONPATH, plugin entry points registered for every vLLM process
. tests/gpu/env.sh
export TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-bench/results/quality}"
WORK="${WORK:-/root/clef-quality}"
mkdir -p "$OUT" "$WORK"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
python3 bench/quality_gpu.py all --work "$WORK" --out "$OUT" ${DATA:+--data "$DATA"} \
    --stages "${STAGES:-train,build,scan,simulate,vllm}" --records "${RECORDS:-400}" \
    --engine-timeout "${ENGINE_TIMEOUT:-240}" ${RETURN_PROXY:+--return-proxy} 2>&1 | tee "$OUT/quality.log"
status=${PIPESTATUS[0]}
cat "$OUT/quality.md" 2>/dev/null
exit "$status"
