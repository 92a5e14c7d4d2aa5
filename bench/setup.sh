# Sourced by the bench scripts (gpu_bench.sh, paired.sh, memory_budget.py's GPU runs): the repository root as the
# working folder (ROOT), the output folder ($OUT, default ./bench-out), the staged vLLM on the GPU
# machine (tests/gpu/env.sh) or else this tree's plugin on PYTHONPATH, and the environment every
# run wants; `healthy URL`, the one readiness check (/health answers 200), `wait_healthy` (a server's
# start-up) and `sample_threads`.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/bench-out}
mkdir -p "$OUT"
if [ -d /root/site ] && [ -f tests/gpu/env.sh ]; then
  # shellcheck disable=SC1091
  source tests/gpu/env.sh
else
  export PYTHONPATH=$ROOT/vllm_plugin${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1

healthy() {  # healthy BASE_URL: its /health answers 200 within 2 s
  "${PY:-python3}" -c "import sys, urllib.request as u; sys.exit(0 if u.urlopen('$1/health', timeout=2).status == 200 else 1)" \
      2>/dev/null
}

wait_healthy() {  # wait_healthy URL PID SECONDS: 0 once URL is healthy, 1 if process PID exited first, 2 after
  # SECONDS of wall time
  local t0=$SECONDS
  until healthy "$1"; do
    kill -0 "$2" 2>/dev/null || return 1
    (( SECONDS - t0 < $3 )) || return 2
    sleep 1
  done
}

sample_threads() {  # sample_threads FILE SECONDS LINES: every SECONDS, the LINES busiest threads (CPU each ran on,
  # %CPU) into FILE, until killed (run it in the background)
  while sleep "$2"; do date +%T.%N; ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -"$3"; done >"$1" 2>&1
}
