"""The kernel sources compile for the GPU: nvcc (sm_80, sm_90, warnings as errors, no spills) and NVRTC.

No GPU is needed.  Each test skips cleanly when its compiler is absent: nvcc for tools/check_cuda.sh,
the NVRTC library (shipped with CuPy's CUDA wheels as nvidia-cuda-nvrtc) for the exact text and name
expressions that `CuPyLauncher` hands to CuPy's RawModule at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.backend import kernel_source

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "check_cuda.sh"


def nvcc() -> str | None:
    return shutil.which(os.environ.get("NVCC", "nvcc"))


def run_check(*files: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *files], capture_output=True, text=True, env=env, timeout=1200)


@pytest.mark.skipif(nvcc() is None, reason="nvcc is not installed")
def test_nvcc_compiles_every_kernel_without_warnings_or_spills():
    proc = run_check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for spec in ks.SPECS.values():
        for targs in spec.instances or [()]:
            expr = spec.name_expression(targs)
            for arch in ("sm_80", "sm_90"):
                assert any(arch in line and f"{expr}(" in line for line in proc.stdout.splitlines()), \
                    f"{expr} missing for {arch} in:\n{proc.stdout}"


@pytest.mark.skipif(nvcc() is None, reason="nvcc is not installed")
def test_check_cuda_fails_on_register_spills(tmp_path):
    """The spill detector itself: a kernel squeezed to 32 registers with many live values must fail."""
    src = tmp_path / "spills.cu"
    src.write_text("""
        __global__ void __launch_bounds__(1024, 2) spill_kernel(float* out, const float* in, int n) {
          float acc[96];
        #pragma unroll
          for (int i = 0; i < 96; ++i) acc[i] = in[i * n + threadIdx.x];
          for (int r = 0; r < n; ++r) {
        #pragma unroll
            for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + r) % 7] + 1.0f;
          }
          float s = 0.0f;
        #pragma unroll
          for (int i = 0; i < 96; ++i) s += acc[i];
          out[threadIdx.x] = s;
        }
    """)
    proc = run_check(str(src))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "register spills" in proc.stdout


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:  # noqa: BLE001 - no CuPy or no NVRTC library: the test does not apply here
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy's NVRTC binding or libnvrtc is not available")
@pytest.mark.parametrize("source", ks.sources())
def test_nvrtc_compiles_the_runtime_source(source):
    """What CuPyLauncher compiles at run time: the header pasted in, every name expression lowered."""
    nvrtc = _nvrtc()
    exprs = [s.name_expression(t) for s in ks.SPECS.values() if s.source == source for t in (s.instances or [()])]
    for arch in ("compute_80", "compute_90"):
        prog = nvrtc.createProgram(kernel_source(source), source, [], [])
        try:
            for expr in exprs:
                nvrtc.addNameExpression(prog, expr)
            try:
                nvrtc.compileProgram(prog, [f"-arch={arch}"])
            except Exception as e:  # noqa: BLE001 - report NVRTC's log, which says what is wrong
                pytest.fail(f"NVRTC rejected {source} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
            for expr in exprs:
                assert nvrtc.getLoweredName(prog, expr).startswith("_Z")
        finally:
            nvrtc.destroyProgram(prog)
