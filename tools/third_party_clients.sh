#!/usr/bin/env bash
# Third-party clients against a real `rawinfer serve` (issue 49: programs nobody on this project wrote must
# work against the HTTP API as they do against vLLM): guidellm 0.8.1's streaming benchmark on the chat
# completions route (it always sends stream_options.continuous_usage_stats and ignore_eos), a short
# synchronous run of synthetic prompts, which must finish every request with zero errors and the output
# lengths it asked for. The server runs the default model from the repository's .venv (made by
# tools/run_tests.sh) on free loopback ports and is stopped at the end whatever happens.
# guidellm needs torch, so it lives in its own venv, .venv-clients (gitignored), made on the first run:
# torch==2.13.0 first (the CPU build where pip finds one on this machine's disk; a plain `torch` would pull
# a CUDA build of several GB), then guidellm==0.8.1. No model hub access: the tokenizer guidellm shapes its
# prompts with is read from the converted model folder.
# Usage: bash tools/third_party_clients.sh
# Environment: PYTHON (the engine's, default .venv/bin/python), CLIENTS_VENV (default .venv-clients),
#              MODEL (default weights/smollm2-135m-instruct),
#              OUT (default $RAWINFER_CACHE/bench/third_party_clients, or under ~/.cache/rawinfer: not the checkout),
#              REQUESTS (default 8), SERVE_ARGS (extra serve flags)
set -euo pipefail
cd "$(dirname "$0")/.."
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-.venv/bin/python}"
VENV="${CLIENTS_VENV:-.venv-clients}"
MODEL="${MODEL:-weights/smollm2-135m-instruct}"
OUT="${OUT:-${RAWINFER_CACHE:-$HOME/.cache/rawinfer}/bench/third_party_clients}"
REQUESTS="${REQUESTS:-8}"
PROMPT_TOKENS=64
OUTPUT_TOKENS=32
API_KEY="third-party-clients-$$"
mkdir -p "$OUT"
[ -x "$PY" ] || { echo "third_party_clients.sh: no $PY; run tools/run_tests.sh first (it makes .venv)" >&2; exit 2; }
[ -f "$MODEL/tokenizer.json" ] || { echo "third_party_clients.sh: no converted model in $MODEL; run tools/fetch_default_model.sh" >&2; exit 2; }

# ---- the clients' venv ------------------------------------------------------------------------------------
versions_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
from importlib.metadata import version
assert version("guidellm") == "0.8.1" and version("torch").split("+")[0] == "2.13.0"
PYEOF
}
if ! versions_ok; then
  echo "third_party_clients.sh: installing guidellm 0.8.1 into $VENV"
  python3 -m venv "$VENV"
  # --no-compile: byte-compiling every file of torch and transformers costs minutes of CPU; Python compiles
  # (and caches) the few modules guidellm imports when it first runs
  pip_q() { "$VENV/bin/python" -m pip install -q --no-compile "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor" || true; }; }
  pip_q torch==2.13.0
  pip_q guidellm==0.8.1
  versions_ok || { echo "third_party_clients.sh: $VENV lacks guidellm 0.8.1 on torch 2.13.0 after pip" >&2; exit 1; }
  echo "third_party_clients.sh: $VENV ready after ${SECONDS} s"
fi

# ---- the server ---------------------------------------------------------------------------------------------
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ZMQ_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
while [ "$HTTP_PORT" = "$ZMQ_PORT" ]; do HTTP_PORT="$(free_port)"; done
BASE="http://127.0.0.1:$HTTP_PORT"
# shellcheck disable=SC2086
"$PY" -m rawinfer serve --model "$MODEL" --bind "tcp://127.0.0.1:$ZMQ_PORT" --http-port "$HTTP_PORT" \
  --api-key "$API_KEY" --kv-cache-memory 64MiB ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
server=$!
stop_server() {
  kill -TERM "$server" 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
MODEL_ID="$("$PY" - "$BASE" "$API_KEY" "$server" <<'PYEOF'
import os, sys, time
import httpx
base, key, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it served; see its log")
    try:
        if httpx.get(base + "/health", timeout=3).status_code == 200:
            models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            print(models.json()["data"][0]["id"])
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("the server did not answer /health with 200 within 300 s; see its log")
PYEOF
)" || { tail -30 "$OUT/serve.log" >&2; exit 1; }
echo "third_party_clients.sh: serving $MODEL as '$MODEL_ID' on $BASE (${SECONDS} s in)"

# ---- guidellm: streaming chat completions, synchronous, synthetic prompts of 64 tokens, 32 out ---------
rm -f "$OUT/guidellm.json"
status=0
"$VENV/bin/guidellm" run \
  --backend "kind=openai_http,target=$BASE,model=$MODEL_ID,api_key=$API_KEY,stream=true,timeout=120" \
  --profile kind=synchronous \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --tokenizer "kind=huggingface_auto,model=$MODEL" \
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console \
  --disable-progress > "$OUT/guidellm.txt" 2>&1 || status=$?
tail -40 "$OUT/guidellm.txt"
if [ "$status" -ne 0 ] || [ ! -f "$OUT/guidellm.json" ]; then
  echo "third_party_clients.sh: guidellm failed (exit $status); the server's last lines:" >&2
  tail -20 "$OUT/serve.log" >&2
  exit 1
fi
"$VENV/bin/python" - "$OUT/guidellm.json" "$REQUESTS" "$OUTPUT_TOKENS" <<'PYEOF' || { tail -20 "$OUT/serve.log" >&2; exit 1; }
import json, statistics, sys
path, want, out_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
benchmarks = json.load(open(path))["benchmarks"]
assert len(benchmarks) == 1, f"guidellm ran {len(benchmarks)} benchmarks, not one"
bench = benchmarks[0]
reqs, state = bench["requests"], bench["scheduler_state"]
problems = [f"request {r['request_id']}: {(r.get('info') or {}).get('error')}" for r in reqs["errored"]]
problems += [f"request {r['request_id']} incomplete" for r in reqs["incomplete"]]
if state["errored_requests"] or state["cancelled_requests"]:
    problems.append(f"{state['errored_requests']} errored, {state['cancelled_requests']} cancelled")
if len(reqs["successful"]) != want:
    problems.append(f"{len(reqs['successful'])} requests succeeded, {want} were asked for")
for r in reqs["successful"]:
    body = json.loads(r["request_args"])["body"]
    if not (body.get("stream") and body.get("stream_options", {}).get("continuous_usage_stats")):
        problems.append(f"request {r['request_id']} was not a stream with continuous usage stats")
    if r["output_tokens"] != out_tokens or not r["output"]:
        problems.append(f"request {r['request_id']}: {r['output_tokens']} output tokens, {out_tokens} asked for")
    if r["info"]["timings"]["token_iterations"] < 2:
        problems.append(f"request {r['request_id']} came in one piece, not streamed")
if problems:
    sys.exit("guidellm's report has errors:\n  " + "\n  ".join(problems[:20]))
ok = reqs["successful"]
print(f"guidellm: {len(ok)} streamed requests, 0 errors; {statistics.median(r['prompt_tokens'] for r in ok):.0f} "
      f"prompt and {out_tokens} output tokens each; TTFT median "
      f"{statistics.median(r['time_to_first_token_ms'] for r in ok):.0f} ms, ITL median "
      f"{statistics.median(r['inter_token_latency_ms'] for r in ok):.1f} ms")
PYEOF
echo "third_party_clients.sh: all clients ran with no error (${SECONDS} s in all)"
