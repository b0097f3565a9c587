#!/usr/bin/env bash
# Run tests with every CPU kernel built for an AVX2-only machine (Haswell: AVX2, FMA, F16C; no AVX-512),
# whatever this machine has: Numba compiles for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, the kernels choose
# their paths from the same features (rawinfer/backend/cpu/isa.py), NumPy's own SIMD loops leave out
# AVX-512 (NPY_DISABLE_CPU_FEATURES) and OpenBLAS runs its Haswell kernel. On an AVX-512 machine this is
# how the AVX2 paths get the whole suite's checks; on an AVX2 machine it is the plain suite.
# The builds are cached apart from the host's (Numba keys its cache by the target CPU and features).
# Usage: bash tools/test_avx2.sh [--avx-vnni] [pytest args...]  (default: the CPU backend and engine tests)
#        bash tools/test_avx2.sh [--avx-vnni] --run COMMAND...    (any command there, e.g. a benchmark)
# --avx-vnni adds AVX-VNNI (256-bit vpdpbusd without AVX-512, as Intel's cores from Alder Lake on have) to
# the target, where this CPU has it: the 8-bit-activation GEMM's tiles then multiply with it (isa.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# code built for Haswell runs only where the CPU has its instructions
EXTRA=""
NEED="avx2 fma f16c bmi2 movbe"
if [ "${1:-}" = "--avx-vnni" ]; then
  shift
  EXTRA=",+avxvnni"
  NEED="$NEED avx_vnni"
fi
for f in $NEED; do
  if ! grep -qw "$f" /proc/cpuinfo; then
    echo "test_avx2.sh: this CPU lacks $f, so code built for that target cannot run here; nothing to do"
    exit 0
  fi
done
export NUMBA_CPU_NAME=haswell
export NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt$EXTRA"
# NumPy disables only its dispatch targets, and of those only the ones this CPU has (it refuses others)
NPY_DISABLE_CPU_FEATURES="$("$PY" -c 'import numpy._core._multiarray_umath as m
print(" ".join(t for t in m.__cpu_dispatch__ if m.__cpu_features__.get(t) and t not in ("X86_V2", "X86_V3")))')"
export NPY_DISABLE_CPU_FEATURES
export OPENBLAS_CORETYPE=Haswell
"$PY" -c "from rawinfer.backend.cpu import isa
assert isa.HOST == isa.AVX2, isa.HOST
print('CPU kernels built for', isa.describe())"
if [ "${1:-}" = "--run" ]; then
  shift
  exec "$@"
fi
if [ $# -eq 0 ]; then
  set -- tests/backend tests/engine/test_engine.py tests/engine/test_model_golden.py tests/engine/test_batch_invariance.py
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
