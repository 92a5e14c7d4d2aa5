#!/usr/bin/env bash
# Paired A/B on one GPU: several clef-systemone servers side by side, compared two at a time with
# `clef-bench A --versus B` (the same requests, one at a time, alternating which server goes first),
# so that both sides of a comparison sample the same minutes of the machine's host-speed lottery
# (docs/latency.md, "The host's speed varies").
#
#   COMPARE="off:on:short,long off:fp8:short" bash bench/paired.sh CKPT "off=ARGS" "on=ARGS" "fp8=ARGS"
#
# Each NAME=ARGS starts one server (ARGS: its clef-systemone flags beyond --model/--port), one after
# the other (each waits for the one before to be ready: vLLM sizes its KV cache from the free memory
# it sees). COMPARE: A:B:WORKLOADS[:CONCURRENCIES] entries (concurrencies default 1; above 1 the servers
# take turns in time blocks). B may be `raw`: raw vLLM `embed` pooling of the same token ids on CKPT, in
# clef-bench's own process (`clef-bench A --versus-raw CKPT --gpu-memory-utilization GPU_SHARE`; RAW_ARGS:
# more raw options, e.g. "--raw-quantization fp8"), e.g. COMPARE="bf16:raw:short:1,16,64". Environment: OUT [./bench-out], GPU_SHARE [0.28] (each
# server's --gpu-memory-utilization), SERVER_FLAGS [--gdn-prefill-backend triton --gpu-memory-utilization
# GPU_SHARE] (flags every server gets; "--backend reference" tries this script without a GPU), PAIRS [300] (-n), TIME_LIMIT [25] (seconds per variant),
# BENCH_ARGS (more clef-bench flags), PORT0 [8900], ENV_<NAME> (VAR=VALUE ... for server NAME's environment only,
# e.g. ENV_exp=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Results: $OUT/<A>_vs_<B>.json/.txt at c=1,
# $OUT/<A>_vs_<B>_c<CONCURRENCIES>.json/.txt otherwise (e.g. core_vs_step_c16-64), $OUT/server_<NAME>.log,
# $OUT/startup.txt (each server's start: seconds to ready, weights, KV cache, kernel lines), $OUT/metrics_<NAME>.txt
# (each server's /metrics after the last comparison), $OUT/paired.log. GPU_EXTRA [0.07]: what each engine holds
# beyond its share (below); a plan whose servers and raw engine cannot fit on the GPU exits 2 before starting any.
set -uo pipefail
CKPT=${1:?usage: COMPARE="a:b:short" bash bench/paired.sh CKPT NAME=ARGS...}
shift
# shellcheck source=bench/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
COMPARE=${COMPARE:?COMPARE="A:B:WORKLOADS ..."}
GPU_SHARE=${GPU_SHARE:-0.28}
SERVER_FLAGS=${SERVER_FLAGS-"--gdn-prefill-backend triton --gpu-memory-utilization $GPU_SHARE"}
PAIRS=${PAIRS:-300}
TIME_LIMIT=${TIME_LIMIT:-25}
BENCH_ARGS=${BENCH_ARGS:-}
PORT0=${PORT0:-8900}
log() { echo "[paired $(date +%H:%M:%S)] $*" | tee -a "$OUT/paired.log" >&2; }

# The GPU's memory: each engine holds its share and ~GPU_EXTRA more by the driver's count (a 9B engine at 0.28 of
# an H200 held 48-49 GiB under load (three servers at 0.28), ~0.065 of the GPU beyond its budget: the plugin's
# graphs and buffers, the CUDA context), and raw vLLM's engine (started last, inside clef-bench) needs its share
# free when it starts. Plans that cannot fit are refused before any server starts (three 9B servers at 0.28 of an
# H200 leave raw 12.9 GiB, too little to start). Skipped for servers without a GPU (--backend reference).
GPU_EXTRA=${GPU_EXTRA:-0.07}
if [[ " $SERVER_FLAGS " != *" --backend reference "* ]]; then
  raw=0
  for entry in $COMPARE; do IFS=: read -r _ b _ <<<"$entry"; [ "$b" = raw ] && raw=1; done
  need=$(awk -v n=$# -v r=$raw -v s="$GPU_SHARE" -v e="$GPU_EXTRA" 'BEGIN { printf "%.3f", n * (s + e) + r * s }')
  if awk -v x="$need" 'BEGIN { exit !(x > 1.0) }'; then
    with_raw=""; (( raw )) && with_raw=" and raw vLLM's engine"
    log "refused: $# server(s) at GPU_SHARE $GPU_SHARE (each ~$GPU_EXTRA more beyond it)$with_raw need $need of the GPU; lower GPU_SHARE or compare fewer servers at once"
    exit 2
  fi
fi

declare -A URL=()
PGIDS=()
cleanup() {  # SIGTERM to each server's process group, up to 5 s to drain and exit, then SIGKILL
  local g i alive
  for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null; done
  for i in {1..50}; do
    alive=0
    for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 0.1
  done
  for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
}
trap cleanup EXIT

port=$PORT0
for spec in "$@"; do
  name=${spec%%=*}
  args=${spec#*=}
  port=$((port + 1))
  env_var="ENV_$name"
  set -m
  # shellcheck disable=SC2086
  env ${!env_var:-} python3 -m clef_vllm.server.cli --model "$CKPT" --host 127.0.0.1 --port "$port" $SERVER_FLAGS $args \
      >"$OUT/server_$name.log" 2>&1 &
  PGIDS+=($!)
  set +m
  URL[$name]="http://127.0.0.1:$port"
  t0=$SECONDS
  if ! wait_healthy "${URL[$name]}" "${PGIDS[-1]}" 400; then
    log "server $name did not start:"; tail -20 "$OUT/server_$name.log" >&2; exit 1
  fi
  log "server $name ready on ${URL[$name]} after $((SECONDS - t0))s ($args${!env_var:+; env ${!env_var}})"
  # what each server's start cost and left it: time, weights, KV cache, the worker's kernel lines
  { echo "== $name: ready after $((SECONDS - t0))s ($args${!env_var:+; env ${!env_var}})"
    grep -hE "engine up in|Model loading took|Available KV cache memory|Maximum concurrency|clef kernels in use|reference backend:" \
        "$OUT/server_$name.log"; } >>"$OUT/startup.txt"
done

for entry in $COMPARE; do
  IFS=: read -r a b workloads conc <<<"$entry"
  conc=${conc:-1}
  # one result file per entry: the same two servers at another concurrency must not overwrite it
  stem="$OUT/${a}_vs_${b}"
  [ "$conc" = 1 ] || stem="${stem}_c${conc//,/-}"
  log "$a vs $b: $workloads at c=$conc"
  limit=300
  if [ "$b" = raw ]; then
    limit=540                        # the raw engine starts inside clef-bench (minutes for a 9B shape)
    versus=(--versus-raw "$CKPT" --gpu-memory-utilization "$GPU_SHARE")
    # shellcheck disable=SC2206
    versus+=(${RAW_ARGS:-})
  else
    versus=(--versus "${URL[$b]}")
  fi
  # shellcheck disable=SC2086
  timeout "$limit" python3 -m clef_vllm.bench.bench_cli "${URL[$a]}" "${versus[@]}" --tokenizer "$CKPT" \
      --workload "$workloads" -c "$conc" -n "$PAIRS" --time-limit "$TIME_LIMIT" --warmup 4 --no-progress \
      --label "$a vs $b" -o "$stem.json" $BENCH_ARGS >"$stem.log" 2>&1
  log "$a vs $b: rc $?"
  cat "$stem.txt" 2>/dev/null | tee -a "$OUT/paired.log"
done
for name in "${!URL[@]}"; do           # each server's counters after every comparison (stages, GC pauses, ...)
  curl -s -m 10 "${URL[$name]}/metrics" >"$OUT/metrics_$name.txt" || log "no /metrics from $name"
done
log "done"
