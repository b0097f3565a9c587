#!/usr/bin/env bash
# gpu_check.sh OUTDIR: everything a GPU machine can tell us, in one run of under 5 minutes.
#
# For a machine with a GPU, no network and only its own Python packages (cupy-cuda12x/13x, numpy,
# numba, safetensors, tokenizers, msgpack, pyzmq, pytest, jinja2, ml_dtypes): run from the source tree,
#
#     tools/gpu_check.sh /tmp/gpu-out          (PYTHON=/path/to/python3 to pick the interpreter)
#
# 1. nvidia-smi summary and package versions      -> OUTDIR/nvidia-smi.txt, OUTDIR/versions.txt
# 2. the GPU test suite: pytest -m gpu tests/backend/test_gpu*.py tests/backend/test_cuda_fused_gpu.py
#    tests/backend/test_cuda_int8_gpu.py (int8 and fp8 weight-only products: GEMV, dequantized tiles +
#    cuBLAS, embedding, tiny int8 and fp8 models against the CPU) tests/backend/test_grammar_mask.py
#    (the structured-output mask kernel; the K/V transfer between two
#    CUDA processes over ZeroMQ, test_gpu_disagg.py, needs pyzmq; it skips without)
#    -> OUTDIR/gpu-tests.log, gpu-tests.xml (kernels incl. the Gemma 3 / Qwen3 ops and sliding-window
#    attention; decode CUDA graphs vs eager, device sampler, pool sizing, whole models)
# 3. tools/gpu_attention_bench.py: prefill attention of one 2,048-token prompt at Llama-3-8B's shape
#    (32 query heads, 8 KV heads, head_dim 128, bf16), the tensor-core kernel against the FMA kernel:
#    agreement, ms and TFLOP/s of each, beside a cuBLAS bf16 GEMM's TFLOP/s
#                                               -> OUTDIR/attention.log, attention.json, attention-table.txt
# 3b. tools/gpu_decode_bench.py: decode attention at Llama-3-8B's shape, batch 1 and 64 x contexts of
#    2,048 and 8,192: today's kernel (GC = 8, splits shortened for small batches) against the former
#    (GC = 4, fixed splits), agreement, us and achieved KV-read GB/s -> OUTDIR/decode.log, decode.json,
#    decode-table.txt
# 4. tools/gpu_bench.py (Llama-3-8B-shaped, bf16, pool sized from free memory, decode CUDA graphs on;
#    decode tokens/s at batch 1 with graphs and eagerly, at batch 64, prefill, bandwidth)
#                                                  -> OUTDIR/bench.log, bench.json, bench-table.txt
# 5. tools/gpu_fused_bench.py: the fused ops (fused_rope_kv_write with and without the q/k norm,
#    norm_add_rmsnorm) against the separate ops at 1, 64 and 2,048 rows, as graphs and eagerly; the decode
#    forward pass at batch 1 and 64 eager / as a graph x fused / separate, the engine's decode step with
#    graphs on and off, and what capturing every bucket cost   -> OUTDIR/fused.log, fused.json, fused-table.txt
# and prints a short summary last.  Each step has a timeout (165 s + 40 s + 60 s + 115 s + 100 s, or
# GPU_CHECK_TESTS_S, GPU_CHECK_ATTENTION_S, GPU_CHECK_DECODE_S, GPU_CHECK_BENCH_S and GPU_CHECK_FUSED_S), so
# the whole run stays under 8 minutes by default.  Exit status: 0 when the tests passed, the attention
# kernels agreed (prefill and decode) and both benchmarks ran.
set -uo pipefail

out=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{ nvidia-smi; echo; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv; } \
  > "$out/nvidia-smi.txt" 2>&1
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
"$py" - > "$out/versions.txt" 2>&1 <<'EOF'
import platform, numpy
print("python", platform.python_version(), "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as e:
    print("cupy unavailable:", e)
from rawinfer.backend.cuda.runtime import cuda_status
print("rawinfer cuda_status:", cuda_status())
EOF

# Where pytest-timeout is installed, one hung test (a stuck kernel, a slow compile) fails alone instead
# of taking the whole step's time with it.
per_test=()
"$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${GPU_CHECK_PER_TEST_S:-100}")
echo "[gpu_check] running the GPU tests (log: $out/gpu-tests.log)"
timeout "${GPU_CHECK_TESTS_S:-165}" "$py" -m pytest -m gpu tests/backend/test_gpu*.py tests/backend/test_cuda_fused_gpu.py \
  tests/backend/test_cuda_int8_gpu.py tests/backend/test_grammar_mask.py \
  -q -rs -p no:cacheprovider --durations=15 "${per_test[@]}" --junitxml="$out/gpu-tests.xml" > "$out/gpu-tests.log" 2>&1
tests_rc=$?

echo "[gpu_check] timing the prefill attention kernels (log: $out/attention.log)"
timeout "${GPU_CHECK_ATTENTION_S:-40}" "$py" tools/gpu_attention_bench.py --out "$out" > "$out/attention.log" 2>&1
attention_rc=$?

echo "[gpu_check] timing the decode attention kernel (log: $out/decode.log)"
timeout "${GPU_CHECK_DECODE_S:-60}" "$py" tools/gpu_decode_bench.py --out "$out" > "$out/decode.log" 2>&1
decode_rc=$?

echo "[gpu_check] running the benchmark (log: $out/bench.log)"
timeout "${GPU_CHECK_BENCH_S:-115}" "$py" tools/gpu_bench.py --out "$out" > "$out/bench.log" 2>&1
bench_rc=$?

echo "[gpu_check] timing the fused ops and decode graphs (log: $out/fused.log)"
timeout "${GPU_CHECK_FUSED_S:-100}" "$py" tools/gpu_fused_bench.py --out "$out" > "$out/fused.log" 2>&1
fused_rc=$?

echo
echo "==================== rawinfer gpu_check $(date -u +%Y-%m-%dT%H:%MZ) ===================="
echo "GPU:       ${gpu:-nvidia-smi failed}"
echo "versions:  $(tr '\n' ' ' < "$out/versions.txt")"
echo "GPU tests: $(grep -E '(passed|failed|error|skipped)' "$out/gpu-tests.log" | tail -1) (exit $tests_rc)"
if [ "$tests_rc" -ne 0 ]; then
  grep -E '^(FAILED|ERROR)' "$out/gpu-tests.log" | head -20
fi
echo "attention: exit $attention_rc"
if [ -f "$out/attention-table.txt" ]; then cat "$out/attention-table.txt"; else tail -5 "$out/attention.log"; fi
echo "decode attention: exit $decode_rc"
if [ -f "$out/decode-table.txt" ]; then cat "$out/decode-table.txt"; else tail -5 "$out/decode.log"; fi
echo "benchmark: exit $bench_rc"
if [ -f "$out/bench-table.txt" ]; then cat "$out/bench-table.txt"; else tail -15 "$out/bench.log"; fi
echo "fused ops and decode graphs: exit $fused_rc"
if [ -f "$out/fused-table.txt" ]; then cat "$out/fused-table.txt"; else tail -15 "$out/fused.log"; fi
[ "$tests_rc" -eq 0 ] && [ "$attention_rc" -eq 0 ] && [ "$decode_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$fused_rc" -eq 0 ]
