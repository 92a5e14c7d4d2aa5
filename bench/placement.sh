#!/usr/bin/env bash
# Does the CPU a server runs on set its single-decision latency? One short decision at c=1 took
# 25.9 to 40 ms p50 on the same 9B-shaped BF16 server across server starts (bench/results README,
# "thirteenth"), with identical graph replays: the step's host work ran at different speeds.
#
#   bash bench/placement.sh CKPT FAST_CPUS SLOW_CPUS [STARTS] [PORT]
#
# STARTS times [3]: start the server (no pinning), then run clef-bench short at c=1 four times:
# as started, with every thread of the server's processes pinned to FAST_CPUS (taskset -a), pinned
# to SLOW_CPUS, and unpinned again. SERVER_ARGS: the server's flags [--gdn-prefill-backend triton
# --load-format dummy] (e.g. "--backend reference" to try this script without a GPU). Results in $OUT/start<i>_<condition>/ (clef-bench JSON and
# table, the busiest threads and the CPU each ran on), server logs in $OUT/start<i>_server.log.
set -uo pipefail
CKPT=${1:?usage: bash bench/placement.sh CKPT FAST_CPUS SLOW_CPUS [STARTS] [PORT]}
FAST=${2:?FAST_CPUS}
SLOW=${3:?SLOW_CPUS}
STARTS=${4:-3}
PORT=${5:-8899}
# shellcheck source=bench/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
URL="http://127.0.0.1:$PORT"
SERVER_ARGS=${SERVER_ARGS-"--gdn-prefill-backend triton --load-format dummy"}
ALL=$(python3 -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
log() { echo "[placement $(date +%H:%M:%S)] $*" | tee -a "$OUT/placement.log" >&2; }

pin() {  # pin PGID CPUS: every thread of every process in the server's group
  local pid
  for pid in $(pgrep -g "$1"); do taskset -a -p -c "$2" "$pid" >/dev/null 2>&1; done
}

bench() {  # bench NAME: short at c=1 with the busiest threads sampled
  local dir=$OUT/$1
  mkdir -p "$dir"
  sample_threads "$dir/threads.txt" 0.5 8 &
  local sampler=$!
  timeout 120 python3 -m clef_vllm.bench.bench_cli "$URL" --tokenizer "$CKPT" --workload short --concurrency 1 \
      --time-limit 4 --warmup 4 --no-progress --label "$1" -o "$dir/bench.json" >"$dir/bench.log" 2>&1
  kill "$sampler" 2>/dev/null
  log "$1: $(grep -E '^short' "$dir/bench.txt" 2>/dev/null | head -1)"
}

for ((i = 1; i <= STARTS; i++)); do
  set -m
  # shellcheck disable=SC2086
  python3 -m clef_vllm.server.cli --model "$CKPT" --host 127.0.0.1 --port "$PORT" $SERVER_ARGS \
      >"$OUT/start${i}_server.log" 2>&1 &
  pgid=$!
  set +m
  t0=$SECONDS
  wait_healthy "$URL" "$pgid" 300
  log "start $i ready after $((SECONDS - t0))s (pids $(pgrep -g "$pgid" | tr '\n' ' '))"
  bench "start${i}_as_started"
  pin "$pgid" "$FAST"; bench "start${i}_fast"
  pin "$pgid" "$SLOW"; bench "start${i}_slow"
  pin "$pgid" "$ALL"; bench "start${i}_unpinned"
  kill -TERM -- "-$pgid" 2>/dev/null
  for _ in $(seq 30); do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pgid" 2>/dev/null
  sleep 3
done
log "done"
