#!/usr/bin/env bash
# Benchmark one checkpoint on the GPU machine: our server under clef-bench, then the raw vLLM
# backbone (embed pooling of the same token ids, same engine settings) under the same sweep, then
# the side-by-side table. Everything lands in $OUT: bench_server.json/.txt, bench_raw.json/.txt,
# compare.json/.txt, parity.json/.md (parity phase), summary.txt, run.json (rc per phase),
# environment.txt, and logs (server.log, <phase>.log, gpu_bench.log).
#
#   bash bench/gpu_bench.sh CKPT [PORT]
#
# Environment knobs (defaults in brackets):
#   OUT               output folder [./bench-out]
#   PHASES            comma list of server,parity,raw,compare [server,raw,compare]
#   WORKLOADS         clef-bench --workload [short,long,fanout]
#   CONC              default concurrency sweep [1,4,16,64]
#   CONC_OVERRIDES    per-workload sweeps ["long=1,4,16 fanout=1,8"]
#   TIME_LIMIT        seconds per point before no new request starts [8]
#   WARMUP            unmeasured requests per variant [4]
#   BENCH_ARGS        extra clef-bench args for both runs (e.g. "--long-tokens 4096,16384 -n 64")
#   SERVER_ARGS       extra clef-systemone args (e.g. "--data-parallel-size 2", "--max-num-seqs 256")
#   RAW_ARGS          extra args for the raw run (e.g. "--raw-engine-arg data_parallel_size=2")
#   RAW_FALLBACK_ARGS retried if the raw run fails ["--raw-arch Qwen3_5ForCausalLM --raw-load-format dummy"]
#   PARITY_ARGS       clef-parity args for the parity phase ["--synthetic 64 -c 8 --device cuda"]
#   LABEL             stored in the results [basename of CKPT]
#   READY_TIMEOUT     seconds for the server to load [420];  BENCH_TIMEOUT per bench run [300]
#   PYTHON            interpreter [python3];  SERVER_BACKEND clef-systemone --backend [vllm]
#   SERVER_WRAP       a command the server runs under (e.g. "taskset -c 0-3": its CPUs) []
#   THREADS           1: sample the busiest threads (CPU each ran on, %CPU) every second of the server's
#                     bench into threads.txt [0]
# The vLLM server runs with --gdn-prefill-backend triton (Hopper). Exit status is
# non-zero if any phase failed; each phase's rc is in $OUT/run.json.
set -uo pipefail

CKPT=${1:?usage: bash bench/gpu_bench.sh CKPT [PORT]}
PORT=${2:-8765}
# shellcheck source=bench/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
CKPT=$(cd "$CKPT" && pwd) || { echo "no such checkpoint: $1" >&2; exit 2; }

PY=${PYTHON:-python3}
SERVER_BACKEND=${SERVER_BACKEND:-vllm}
PHASES=${PHASES:-server,raw,compare}
WORKLOADS=${WORKLOADS:-short,long,fanout}
CONC=${CONC:-1,4,16,64}
CONC_OVERRIDES=${CONC_OVERRIDES-long=1,4,16 fanout=1,8}
TIME_LIMIT=${TIME_LIMIT:-8}
WARMUP=${WARMUP:-4}
BENCH_ARGS=${BENCH_ARGS:-}
SERVER_ARGS=${SERVER_ARGS:-}
RAW_ARGS=${RAW_ARGS:-}
RAW_FALLBACK_ARGS=${RAW_FALLBACK_ARGS-"--raw-arch Qwen3_5ForCausalLM --raw-load-format dummy"}
PARITY_ARGS=${PARITY_ARGS:-"--synthetic 64 -c 8 --device cuda"}
LABEL=${LABEL:-$(basename "$CKPT")}
READY_TIMEOUT=${READY_TIMEOUT:-420}
SERVER_WRAP=${SERVER_WRAP:-}
THREADS=${THREADS:-0}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
URL="http://127.0.0.1:$PORT"

log() { echo "[gpu_bench $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_bench.log" >&2; }
has_phase() { [[ ",$PHASES," == *",$1,"* ]]; }

declare -A RC=()
SERVER_PID=""

kill_group() {  # TERM a process group, KILL it after 30 s
  local pgid=$1
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  for _ in $(seq 30); do kill -0 -- "-$pgid" 2>/dev/null || return 0; sleep 1; done
  log "process group $pgid still alive after 30 s: KILL"
  kill -KILL -- "-$pgid" 2>/dev/null
}

wait_gpu_free() {  # until no compute process holds our GPUs (max 90 s); other jobs may use the others
  command -v nvidia-smi >/dev/null || return 0
  local ids=()
  [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && ids=(-i "$CUDA_VISIBLE_DEVICES")
  for _ in $(seq 90); do
    [ -z "$(nvidia-smi "${ids[@]}" --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  log "GPU still busy after 90 s:"; nvidia-smi >>"$OUT/gpu_bench.log" 2>&1
}

stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  log "stopping server (pid $SERVER_PID)"
  kill_group "$SERVER_PID"
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
  wait_gpu_free
}
trap stop_server EXIT
trap 'log "interrupted"; exit 130' INT TERM

run_phase() {  # run_phase NAME LIMIT_S CMD... : output -> NAME.log, in its own process group
  local name=$1 limit=$2; shift 2
  log "$name: $*"
  set -m
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  set +m
  local waited=0
  while kill -0 "$pid" 2>/dev/null; do
    if (( waited >= limit )); then log "$name: timeout after ${limit}s"; kill_group "$pid"; break; fi
    sleep 1; waited=$((waited + 1))
  done
  wait "$pid"; local rc=$?
  kill_group "$pid"  # engine processes left behind by the leader
  RC[$name]=$rc
  log "$name: rc=$rc after ${waited}s"
  return "$rc"
}

bench_cmd() {  # the sweep both runs share
  # shellcheck disable=SC2086
  echo --workload "$WORKLOADS" --concurrency "$CONC" $CONC_OVERRIDES --time-limit "$TIME_LIMIT" \
       --warmup "$WARMUP" --no-progress $BENCH_ARGS
}

{
  echo "checkpoint: $CKPT"; echo "port: $PORT"; echo "phases: $PHASES"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
  nvidia-smi 2>/dev/null || echo "no nvidia-smi"
  lscpu 2>/dev/null
} >"$OUT/environment.txt"
START=$(date +%s)

# ---------------------------------------------------------------- server + clef-bench (+ parity)
if has_phase server || has_phase parity; then
  log "starting clef-systemone on $URL"
  set -m
  gdn=$([ "$SERVER_BACKEND" = vllm ] && echo "--gdn-prefill-backend triton")   # a vLLM flag: refused elsewhere
  # shellcheck disable=SC2086
  $SERVER_WRAP "$PY" -m clef_vllm.server.cli --model "$CKPT" --backend "$SERVER_BACKEND" --host 127.0.0.1 --port "$PORT" \
      $gdn $SERVER_ARGS >"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  set +m
  t0=$SECONDS
  wait_healthy "$URL" "$SERVER_PID" "$READY_TIMEOUT"; started=$?
  if (( started == 1 )); then log "server exited during start-up:"; tail -30 "$OUT/server.log" >&2; fi
  if (( started == 0 )); then
    log "server ready after $((SECONDS - t0))s"
    RC[server_start]=0
    if has_phase server; then
      sampler=""
      if [ "$THREADS" = 1 ]; then
        sample_threads "$OUT/threads.txt" 1 12 &
        sampler=$!
      fi
      # shellcheck disable=SC2046
      run_phase bench_server "$BENCH_TIMEOUT" "$PY" -m clef_vllm.bench.bench_cli "$URL" --tokenizer "$CKPT" \
          $(bench_cmd) --label "$LABEL server" -o "$OUT/bench_server.json"
      [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
    fi
    if has_phase parity; then
      # shellcheck disable=SC2086
      run_phase parity "$BENCH_TIMEOUT" "$PY" -m clef_vllm.bench.parity_cli "$URL" "reference:$CKPT" \
          --no-progress --label "$LABEL" -o "$OUT/parity.json" --summary "$OUT/parity.md" $PARITY_ARGS
    fi
  else
    log "server not ready after ${READY_TIMEOUT}s"; RC[server_start]=1
  fi
  stop_server
fi

# ---------------------------------------------------------------- raw vLLM baseline
if has_phase raw; then
  # shellcheck disable=SC2046,SC2086
  if ! run_phase bench_raw "$BENCH_TIMEOUT" "$PY" -m clef_vllm.bench.bench_cli --raw-vllm "$CKPT" \
        $(bench_cmd) --label "$LABEL raw-vllm" -o "$OUT/bench_raw.json" $RAW_ARGS \
     && [ -n "$RAW_FALLBACK_ARGS" ]; then
    wait_gpu_free
    log "raw run failed; retrying with $RAW_FALLBACK_ARGS"
    mv "$OUT/bench_raw.log" "$OUT/bench_raw.first-attempt.log" 2>/dev/null
    # shellcheck disable=SC2046,SC2086
    run_phase bench_raw "$BENCH_TIMEOUT" "$PY" -m clef_vllm.bench.bench_cli --raw-vllm "$CKPT" \
        $(bench_cmd) --label "$LABEL raw-vllm (fallback)" -o "$OUT/bench_raw.json" $RAW_ARGS $RAW_FALLBACK_ARGS
  fi
  wait_gpu_free
fi

# ---------------------------------------------------------------- side by side
if has_phase compare && [ -f "$OUT/bench_raw.json" ] && [ -f "$OUT/bench_server.json" ]; then
  run_phase compare 60 "$PY" -m clef_vllm.bench.bench_cli --compare "$OUT/bench_raw.json" "$OUT/bench_server.json" \
      -o "$OUT/compare.json"
fi

# ---------------------------------------------------------------- summary
{
  for f in bench_server.txt bench_raw.txt compare.txt parity.md; do  # tables the tools write next to their JSON
    [ -s "$OUT/$f" ] && { cat "$OUT/$f"; echo; }
  done
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
status=0
json="{\"checkpoint\": \"$CKPT\", \"label\": \"$LABEL\", \"phases\": \"$PHASES\", \"wall_s\": $(( $(date +%s) - START )), \"rc\": {"
sep=""
for k in "${!RC[@]}"; do
  json+="$sep\"$k\": ${RC[$k]}"; sep=", "
  [ "${RC[$k]}" = 0 ] || status=1
done
echo "$json}}" >"$OUT/run.json"
log "done in $(( $(date +%s) - START ))s, status $status; files in $OUT"
exit "$status"
