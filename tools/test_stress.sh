#!/usr/bin/env bash
# Run the README's test command (`make test`) under the conditions a user's machine may be in, and
# record how long each run took and whether it passed:
#
#   idle    nothing else started by this script (run it on an otherwise quiet machine)
#   loaded  every core busy with another job: one busy loop per core, at the same priority,
#           started before the run and stopped after it (each bounded by `timeout` as well)
#   pinned  the whole run, every process it starts included, on one core (`taskset -c 0`)
#
# Usage: tools/test_stress.sh [--idle-runs N] [CONDITION ...]   (default: idle loaded pinned)
#        make test-stress                                       (the same, with its defaults)
# Each run's output goes to $STRESS_DIR/<n>-<condition>.log; one line per run is appended to
# $STRESS_DIR/results.tsv (condition, exit code, seconds, start time) and printed at the end.
# Exit code: 0 when every run passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

IDLE_RUNS=1
CONDITIONS=()
while (($#)); do
  case "$1" in
    --idle-runs) IDLE_RUNS="$2"; shift 2 ;;
    idle|loaded|pinned) CONDITIONS+=("$1"); shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "test_stress.sh: unknown argument '$1' (conditions: idle, loaded, pinned; --idle-runs N)" >&2; exit 2 ;;
  esac
done
((${#CONDITIONS[@]})) || CONDITIONS=(idle loaded pinned)

STRESS_DIR="${STRESS_DIR:-runs/test-stress}"
TEST_COMMAND="${TEST_COMMAND:-make test}"  # the README's test command
LOAD_LIMIT_S="${LOAD_LIMIT_S:-7200}"  # a busy loop ends by itself after this, whatever happens to us
mkdir -p "$STRESS_DIR"
RESULTS="$STRESS_DIR/results.tsv"
[[ -f "$RESULTS" ]] || printf 'condition\texit_code\tseconds\tstarted_utc\n' >"$RESULTS"

LOAD_PIDS=()
RUN_PID=""
stop_run() {  # the test run in progress, with every process of its group (it runs under setsid)
  if [[ -n "$RUN_PID" ]]; then
    kill -TERM -- "-$RUN_PID" 2>/dev/null || true
    wait "$RUN_PID" 2>/dev/null || true
    RUN_PID=""
  fi
}
stop_load() {
  local pid
  for pid in "${LOAD_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${LOAD_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  LOAD_PIDS=()
}
trap stop_load EXIT
trap 'stop_run; stop_load; exit 130' INT TERM

start_load() {
  local cores i
  cores="$(nproc)"
  for ((i = 0; i < cores; i++)); do
    timeout "$LOAD_LIMIT_S" bash -c 'while :; do :; done' &
    LOAD_PIDS+=("$!")
  done
  echo "started $cores busy loop(s): ${LOAD_PIDS[*]}"
}

run_once() {  # $1: condition, $2: run number
  local condition="$1" log="$STRESS_DIR/$2-$1.log" started code seconds begin
  local command=($TEST_COMMAND)
  [[ "$condition" == pinned ]] && command=(taskset -c 0 "${command[@]}")
  [[ "$condition" == loaded ]] && start_load
  started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  begin="$(date +%s)"
  echo "== $condition: ${command[*]} (log $log)"
  # In the background, waited for: a signal to this script runs its trap at once (not after the run).
  setsid "${command[@]}" >"$log" 2>&1 &
  RUN_PID=$!
  wait "$RUN_PID"
  code=$?
  RUN_PID=""
  seconds=$(($(date +%s) - begin))
  [[ "$condition" == loaded ]] && stop_load
  printf '%s\t%s\t%s\t%s\n' "$condition" "$code" "$seconds" "$started" | tee -a "$RESULTS"
  tail -n 3 "$log"
  return "$code"
}

failed=0
n=0
for condition in "${CONDITIONS[@]}"; do
  runs=1
  [[ "$condition" == idle ]] && runs="$IDLE_RUNS"
  for ((i = 0; i < runs; i++)); do
    n=$((n + 1))
    run_once "$condition" "$n" || failed=1
  done
done
echo "== results ($RESULTS)"
cat "$RESULTS"
exit "$failed"
