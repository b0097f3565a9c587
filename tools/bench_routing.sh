#!/usr/bin/env bash
# Cache-aware vs round-robin routing over engine replicas (issue 21): for each policy, start
# `rawinfer serve --replicas N` on a local Ray cluster, wait until every replica serves, run the multi-turn
# workload of `rawinfer bench serve` against it, stop it. One JSON result per policy in $OUT.
# Usage: bash tools/bench_routing.sh [extra bench serve flags]
# Environment: PYTHON, OUT (default bench_results/routing), POLICIES (default "cache_aware round_robin"),
#              REPLICAS (default 2), SERVE_ARGS (extra serve flags), WORKLOAD (the workload flags).
set -euo pipefail
cd "$(dirname "$0")/.."
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE          # as a user's machine runs
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-bench_results/routing}"
POLICIES="${POLICIES:-cache_aware round_robin}"
REPLICAS="${REPLICAS:-2}"
WORKLOAD="${WORKLOAD:---conversations 9 --turns 4 --input-len 512 --turn-input-len 64 --output-len 32 --request-rate 0.6 --seed 0}"
ADDR="tcp://127.0.0.1:5597"
mkdir -p "$OUT"
for policy in $POLICIES; do
  # shellcheck disable=SC2086
  "$PY" -m rawinfer serve --replicas "$REPLICAS" --routing "$policy" --no-http --bind "$ADDR" ${SERVE_ARGS:-} \
    > "$OUT/serve-$policy.log" 2>&1 &
  server=$!
  trap 'kill -TERM $server 2>/dev/null || true' EXIT
  "$PY" - "$ADDR" "$REPLICAS" <<'PYEOF'
import sys, time
from rawinfer.frontends.client.client import Client, ServerTimeout
addr, n = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
with Client(addr, timeout_s=5) as c:
    while time.monotonic() < deadline:
        try:
            reps = c.stats()["replicas"].values()
            if [r["state"] for r in reps] == ["up"] * n:
                sys.exit(0)
        except ServerTimeout:
            pass
        time.sleep(1)
sys.exit(f"the replicas did not all serve within 600 s; see the serve log")
PYEOF
  # shellcheck disable=SC2086
  "$PY" -m rawinfer bench serve --addr "$ADDR" $WORKLOAD --json "$OUT/$policy.json" "$@" | tee "$OUT/$policy.txt"
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
done
