#!/usr/bin/env bash
# Run tests with every CPU kernel built for a plain x86-64 machine (SSE2 only: no AVX, AVX2, FMA or F16C),
# whatever this machine has: Numba compiles for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES and the kernels choose
# their paths from the same features (rawinfer/backend/cpu/isa.py), so this is the portable path a CPU
# without AVX2 takes: plain Numba loops, generic vector IR for the int8 and q4 GEMMs and the q4 dot products,
# row-invariant dot products (rows.py; BLAS for float32 prompts of more than 96 rows), float16 converted in
# integer operations (half.py). OpenBLAS runs its Nehalem (SSE) kernel. The builds are cached apart from
# the host's (Numba keys its cache by the target CPU and features).
# Usage: bash tools/test_portable.sh [pytest args...]   (default: golden agreement and batch invariance of
# every weight format, the float16 conversions, the row-invariant products, the int8 and q4 GEMMs and the
# silu epilogue's exp; about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if ! grep -qw sse2 /proc/cpuinfo; then
  echo "test_portable.sh: this CPU is not x86-64 with SSE2; nothing to do"
  exit 0
fi
export NUMBA_CPU_NAME=x86-64
export NUMBA_CPU_FEATURES="+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2"
export OPENBLAS_CORETYPE=Nehalem
"$PY" -c "from rawinfer.backend.cpu import half, isa; assert isa.HOST == isa.PORTABLE and not half.F16C, isa.HOST
print('CPU kernels built for', isa.HOST, '(no F16C)')"
if [ $# -eq 0 ]; then
  set -- tests/backend/test_half.py tests/backend/test_rows.py tests/engine/test_model_golden.py \
    tests/engine/test_batch_invariance.py tests/backend/test_q4.py tests/backend/test_quant.py \
    tests/backend/test_cpu_qgemm.py tests/backend/test_qgemm_isa.py tests/backend/test_vmath.py \
    tests/backend/test_q4gemm.py
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
