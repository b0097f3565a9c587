"""rawinfer/backend/cuda/cublas.py without a GPU: the cuBLAS calls it makes, against a stand-in library.

What the GPU suite found on the first real device: a GEMM recorded into a CUDA graph must not set the
handle's stream while the stream captures (CuPy's wrappers do, and refuse). So the handle's stream (and
workspace, which cublasSetStream resets) is set only when the stream changes, the pointer mode once, and
a failing call raises an error naming the function and status."""

from __future__ import annotations

import ctypes

import pytest

from rawinfer.backend.cuda import cublas as C


class FakeLibrary:
    """Records every call (name, args); cublasCreate_v2 hands out handle 0x1234; statuses from `fail`."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}

    def __getattr__(self, name):
        def fn(*args):
            if name == "cublasCreate_v2":
                args[0]._obj.value = 0x1234          # the handle behind ctypes.byref
            self.calls.append((name, args))
            return self.fail.get(name, 0)
        setattr(self, name, fn)                      # argtypes / restype land on the function object
        return fn

    def names(self):
        return [n for n, _ in self.calls]


@pytest.fixture
def lib(monkeypatch):
    fake = FakeLibrary()
    monkeypatch.setattr(C, "load_library", lambda: fake)
    return fake


def _gemm(blas, stream):
    blas.gemm(stream, True, False, 64, 8, 32, 1, 2, C.CUDA_R["bf16"], 32, 3, C.CUDA_R["bf16"], 32, 4, 5,
              C.CUDA_R["float"], 64)


def test_stream_and_workspace_are_set_only_when_the_stream_changes(lib):
    blas = C.Cublas(workspace_ptr=0xBEEF, workspace_bytes=1 << 20)
    assert lib.names() == ["cublasCreate_v2", "cublasSetPointerMode_v2"]
    assert lib.calls[1][1][1] == C.POINTER_MODE_HOST
    del lib.calls[:]
    blas.set_stream(77)                              # what capture() does before it begins recording
    _gemm(blas, 77)                                  # inside the capture: no stream call at all
    _gemm(blas, 77)
    assert lib.names() == ["cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx", "cublasGemmEx"]
    assert lib.calls[1][1][1:] == (0xBEEF, 1 << 20)
    del lib.calls[:]
    _gemm(blas, 0)                                   # back on the default stream: set again, workspace too
    assert lib.names() == ["cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"]
    assert lib.calls[0][1][1] is None                # stream 0 goes in as a null pointer
    gemm = lib.calls[2][1]
    assert gemm[1:6] == (C.OP_T, C.OP_N, 64, 8, 32) and gemm[-2:] == (C.COMPUTE_32F, C.GEMM_DEFAULT)


def test_a_failing_call_names_the_function_and_the_status(lib):
    blas = C.Cublas(workspace_ptr=1, workspace_bytes=1)
    lib.fail["cublasGemmEx"] = 7
    with pytest.raises(RuntimeError, match="cublasGemmEx failed: CUBLAS_STATUS_INVALID_VALUE"):
        _gemm(blas, 0)
    lib.fail["cublasCreate_v2"] = 3
    with pytest.raises(RuntimeError, match="cublasCreate failed: CUBLAS_STATUS_ALLOC_FAILED"):
        C.Cublas(workspace_ptr=1, workspace_bytes=1)


def test_no_library_is_an_error_that_names_the_fix(monkeypatch):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(C, "_loaded_path", lambda: None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    with pytest.raises(RuntimeError, match="cupy-cuda12x or cupy-cuda13x") as e:
        C.load_library()
    assert "libcublas.so.13" in str(e.value) and "libcublas.so.12" in str(e.value)


def test_the_loaded_library_is_found_in_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libcublasLt.so.13\n"
                    "7f02-7f03 r-xp 0 00:00 0 /site/nvidia/cublas/lib/libcublas.so.13\n")
    real = C.Path
    monkeypatch.setattr(C, "Path", lambda p: real(maps) if p == "/proc/self/maps" else real(p))
    assert C._loaded_path() == "/site/nvidia/cublas/lib/libcublas.so.13"
