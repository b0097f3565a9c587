"""Same inputs, same bits: the CPU kernels whose results could depend on timing or on reused memory.

Greedy decoding of the q4 SmolLM2 model answered differently from run to run (the SmolLM2 test here is
that case); two defects, each also tested directly:
- blas.py's GEMMs inside Numba's parallel regions must run single-threaded, but now and then ran on
  OpenBLAS's own threads, which split a GEMM differently and round differently: in NumPy's OpenBLAS
  (a pthreads build) the thread count is process-wide, and each worker set it to 1 and restored it,
  so one worker restored it while another was still calling sgemm;
- kernels that hand the raw address of an array they allocated to a block or to BLAS let Numba
  release the array before the read (it releases an array after its last use by name):
  prefill_attention's gathered K, V and Q, the AVX2 decode attention's q and scores. Freed memory
  usually still holds the values, so the test runs them where it does not (PYTHONMALLOC=debug
  overwrites every freed block).

And one more way the bits could change between runs, from process to process: the process that compiles a
kernel and the later ones that load it from the kernel cache run two differently optimized copies of a
parallel build, which rounded differently while the attention kernels let the optimizer reassociate
(docs/kernels.md); the last test here compares the two.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from rawinfer.backend.cpu import blas as cpu_blas
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.attention import attention_work_items
from rawinfer.backend.cpu.backend import CPUBackend
from rawinfer.quant import Q4Weight, dequantize_q4, quantize_q4
from reference_ops import int8_matmul_ref, make_paged_batch, paged_attention_ref

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CALLS = 40


def _openblas():
    """(set, get) of NumPy's OpenBLAS's process-wide thread count, or None."""
    if not cpu_blas.available():
        return None
    lib = ctypes.CDLL(cpu_blas._find_library())
    try:
        return lib.scipy_openblas_set_num_threads64_, lib.scipy_openblas_get_num_threads64_
    except AttributeError:
        return None


def _blas_cases(rng):
    """name -> a call of a blas.py kernel on 2 parts (one per worker) writing into a fresh array."""
    M, N, K = 37, 960, 576                        # a prefill of SmolLM2's QKV projection
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    qs, dm = quantize_q4(w)
    scratch = np.zeros(2 * 32 * K, np.float32)
    H, Hkv, D, BS = 9, 3, 64, 16
    qkv, kc, vc, tables, ctx, qsl = make_paged_batch(rng, np.float32, [70, 40], [150, 40], H, Hkv, D, BS)
    seqs, q0, q1 = attention_work_items(qsl, 64)

    def matmul():
        out = np.zeros((M, N), np.float32)
        cpu_blas.matmul_nt(x, w, out, 2)
        return out

    def q4_tiles():
        out = np.zeros((M, N), np.float32)
        cpu_blas.quant_matmul_nt(x, qs.view(np.uint16), dm.view(np.uint16), out, scratch, 32, 2)
        return out

    def attention():
        out = np.zeros((qkv.shape[0], H * D), np.float32)
        cpu_blas.prefill_attention(qkv, kc, vc, tables, ctx, qsl, seqs, q0, q1, np.float32(D ** -0.5), H, 0, out, 2)
        return out
    return {"matmul_nt": matmul, "quant_matmul_nt": q4_tiles, "prefill_attention": attention}


@pytest.mark.skipif(_openblas() is None, reason="NumPy's BLAS is not the OpenBLAS build blas.py calls")
@pytest.mark.skipif(numba.get_num_threads() < 2, reason="a race needs two workers")
@pytest.mark.parametrize("name", ["matmul_nt", "quant_matmul_nt", "prefill_attention"])
def test_blas_kernels_run_single_threaded_and_leave_the_openblas_thread_count(name):
    """Each call starts with OpenBLAS's count at 2 or more, as a fresh process has it (a call that left it
    at 1 would hide the race from every later one); every call must give the bits of single-threaded
    GEMMs (the count at 1 throughout) and leave the count as it found it."""
    setn, getn = _openblas()
    before = getn()
    run = _blas_cases(np.random.default_rng(5))[name]
    threads = max(2, before)
    differ = changed = 0
    try:
        setn(1)
        ref = run()
        for _ in range(CALLS):
            setn(threads)
            differ += not np.array_equal(run(), ref)
            changed += getn() != threads
    finally:
        setn(before)
    assert (differ, changed) == (0, 0), \
        f"of {CALLS} calls, {differ} differ from single-threaded GEMMs, {changed} changed OpenBLAS's thread count"


@contextlib.contextmanager
def _busy_core(on: bool = True):
    """A busy-looping child process for the duration (when on), always stopped."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(_openblas() is None, reason="NumPy's BLAS is not the OpenBLAS build blas.py calls")
@pytest.mark.skipif(numba.get_num_threads() < 2, reason="a race needs two workers")
def test_smollm2_q4_gives_the_same_logits_in_every_run(smollm2_q4_dir):
    """The reported case: `rawinfer generate` with the q4 model answered "What is the capital of
    France?" with "The capital ..." in some runs and "L'Étoile, ..." in others. Its first token is all
    but a tie between "L" and "The", so the prefill's GEMMs rounding differently from run to run
    decided it. Scored with OpenBLAS's thread count at 1 throughout (no GEMM can run
    threaded), then 40 times with the count where a fresh process has it, 8 of them with a core busy:
    every logit the same every time."""
    from rawinfer import LLMEngine
    from rawinfer.engine.tokenizer import chat_messages, render_chat
    engine = LLMEngine(smollm2_q4_dir, device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False)
    prompt = render_chat(engine.tokenizer, chat_messages("What is the capital of France?", None))
    ids = engine.tokenizer.encode(prompt)
    assert len(ids) >= 32                        # long enough for the prefill's BLAS attention too
    setn, getn = _openblas()
    before = getn()
    differ = 0
    try:
        setn(1)
        ref = engine.score(ids)
        for busy in (False, True):
            with _busy_core(busy):
                for _ in range(32 if not busy else 8):
                    setn(max(2, before))
                    differ += not np.array_equal(engine.score(ids), ref)
    finally:
        setn(before)
    assert differ == 0, f"{differ} of 40 runs differ from the single-threaded one"


def _raw_address_kernels():
    """The kernels that read arrays through raw addresses, against NumPy (run by the test below in a
    process where freed memory is overwritten)."""
    be = CPUBackend()
    rng = np.random.default_rng(3)
    H, Hkv, D, BS = 9, 3, 64, 16
    # pure decode (the AVX2 kernel where it fits), then prefill chunks long enough for the BLAS kernel
    for q_lens, ctx_lens in (([1, 1, 1], [5, 40, 100]), ([70, 40], [150, 40])):
        qkv, kc, vc, tables, ctx, qsl = make_paged_batch(rng, np.float32, q_lens, ctx_lens, H, Hkv, D, BS)
        out = np.full((qkv.shape[0], H * D), np.nan, np.float32)
        be.paged_attention(qkv, kc, vc, tables, ctx, qsl, D ** -0.5, out, max(q_lens), max(ctx_lens))
        ref = paged_attention_ref(qkv, kc, vc, tables, ctx, qsl, D ** -0.5, H)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5, err_msg=f"attention, queries {q_lens}")
    if cpu_llvm.available():                                   # the q4 matrix-vector kernels
        x = rng.standard_normal((3, 576)).astype(np.float32)
        qs, dm = quantize_q4(rng.standard_normal((320, 576)).astype(np.float32))
        w = dequantize_q4(qs, dm).astype(np.float64)
        out = np.zeros((3, 320), np.float32)
        be.linear(x, Q4Weight(qs, dm), out)
        np.testing.assert_allclose(out, x @ w.T, rtol=1e-3, atol=1e-2, err_msg="q4 matvec")
        act = np.zeros((3, 160), np.float32)
        be.linear_silu_mul(x, Q4Weight(qs, dm), None, act)
        g, u = out[:, :160].astype(np.float64), out[:, 160:]        # the products as the kernel rounds them
        np.testing.assert_allclose(act, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-5, err_msg="q4 matvec silu")
    from rawinfer.backend.cpu import qgemm
    # the integer GEMM and its silu epilogue
    x = rng.standard_normal((13, 576)).astype(np.float32)
    q = rng.integers(-127, 128, (64, 576)).astype(np.int8)
    s = rng.random(64).astype(np.float32) * 0.01
    xbuf, sbuf = (np.empty(n, t) for n, t in zip(qgemm.x_buffer_sizes(13, 576), (np.int16, np.float32)))
    out = np.zeros((13, 64), np.float32)
    qgemm.int8_matmul(x, qgemm.pack_weights(q), s, out, xbuf, sbuf)
    ref = int8_matmul_ref(x, q, s, qgemm.act_qmax(576))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg="int8 GEMM")
    out = np.zeros((13, 32), np.float32)
    qgemm.int8_matmul_silu(x, qgemm.pack_weights(q), s, out, xbuf, sbuf)
    g, u = ref[:, :32], ref[:, 32:]
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-5, err_msg="int8 GEMM silu")


def _in_new_process(call: str, timeout: int, **env) -> None:
    """Run `call` (an expression on this module, as `t`) in a fresh interpreter with `env` added to the
    environment; fails the test with the child's stderr if it fails."""
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {os.path.dirname(HERE)!r}, {HERE!r}]\n"
            f"import test_determinism as t; {call}")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]


def test_raw_address_kernels_keep_their_arrays_alive():
    """PYTHONMALLOC=debug fills every freed block (Numba's arrays included) with 0xDD: a kernel reading
    an array it has released sees garbage instead of the values the block happened to keep."""
    _in_new_process("t._raw_address_kernels()", 600, PYTHONMALLOC="debug")


def _kernel_outputs(cache_dir: str, out_path: str) -> None:
    """Every kernel whose build carries float arithmetic an optimizer could reorder, on fixed inputs,
    saved to out_path; the kernel cache in cache_dir (run by the test below, once compiling into it and
    once loading from it). Also saves how many builds this process compiled."""
    from rawinfer.backend.cpu import cache as cpu_cache
    from rawinfer.backend.cpu import attention as A
    from rawinfer.backend.cpu import fgemm, qgemm
    from rawinfer.quant import Int8Weight, quantize_int8
    from paged_cases import paged_case
    be = CPUBackend(cache_dir=cache_dir)
    rng = np.random.default_rng(11)
    got = {}
    H, Hkv, D, BS = 9, 3, 64, 16
    for kv in (np.float32, np.float16, np.int8):
        # decode rows, short chunks (the tiled kernel), long ones (BLAS), then a pure decode batch
        for name, q_lens, ctx_lens in (("mixed", [1, 5, 20, 40, 130], [30, 9, 20, 57, 150]),
                                       ("decode", [1] * 20, list(range(3, 203, 10)))):
            qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 5, kv_dtype=kv)
            out = np.zeros((qkv.shape[0], H * D), np.float32)
            be.paged_attention(qkv, kc, vc, tables, ctx, qsl, D ** -0.5, out, max(q_lens), max(ctx_lens))
            got[f"attention {name} {np.dtype(kv).name}"] = out
            if name == "decode":                      # the portable kernel, which the AVX2 one replaces here
                if kv == np.float16:
                    kc, vc = kc.view(np.uint16), vc.view(np.uint16)
                out = np.zeros_like(out)
                A.decode_attention_kernel(len(q_lens) * Hkv, qkv, kc, vc, tables, ctx, np.float32(D ** -0.5), H, 0,
                                          out)
                got[f"portable decode {np.dtype(kv).name}"] = out
    x = rng.standard_normal((3, 576)).astype(np.float32)
    w = rng.standard_normal((320, 576)).astype(np.float32)
    q, s = quantize_int8(w)
    for name, fn in (("linear", be.linear), ("linear_silu_mul", lambda x, w, o: be.linear_silu_mul(x, w, None, o))):
        for kind, weight in (("int8 rows", Int8Weight(q, s)), ("q4", Q4Weight(*quantize_q4(w)))):
            out = np.zeros((3, 320 if name == "linear" else 160), np.float32)
            fn(x, weight, out)
            got[f"{name} {kind}"] = out
    gu = rng.standard_normal((7, 320)).astype(np.float32)
    for name, op in (("silu_mul", be.silu_mul), ("gelu_tanh_mul", be.gelu_tanh_mul)):
        out = np.zeros((7, 160), np.float32)
        op(gu, out)
        got[name] = out
    if fgemm.available():
        out = np.zeros((5, 320), np.float32)
        fgemm.matmul_nt(rng.standard_normal((5, 576)).astype(np.float32), w, out, 2)
        got["fgemm"] = out
    xx = rng.standard_normal((13, 576)).astype(np.float32)
    xbuf, sbuf = (np.empty(n, t) for n, t in zip(qgemm.x_buffer_sizes(13, 576), (np.int16, np.float32)))
    out = np.zeros((13, 160), np.float32)
    qgemm.int8_matmul_silu(xx, qgemm.pack_weights(q), s, out, xbuf, sbuf)
    got["int8 GEMM silu"] = out
    compiled = sum(sum(d.stats.cache_misses.values()) for d in cpu_cache._dispatchers())
    np.savez(out_path, compiled=compiled, **got)


def test_kernels_give_the_same_bits_compiled_here_or_loaded_from_the_cache(tmp_path):
    """The process that compiles a kernel and every later one that loads it from the kernel cache must
    compute the same bits: a user's first run (which compiles) and their next runs must agree. Numba
    compiles a parallel build's loop body as its own library and links a copy of it, optimized again,
    into the code it caches, so any freedom the compiler has to reorder float arithmetic (fastmath's
    reassoc, nsz, ...) can be used differently in the two copies."""
    outs = []
    for run in ("compile", "load"):
        path = str(tmp_path / f"{run}.npz")
        _in_new_process(f"t._kernel_outputs({str(tmp_path / 'cache')!r}, {path!r})", 900)
        outs.append(dict(np.load(path)))
    compiled, loaded = outs
    assert compiled.pop("compiled") > 0 and loaded.pop("compiled") == 0      # the second run compiled nothing
    differ = [k for k in compiled if not np.array_equal(compiled[k], loaded[k])]
    assert not differ, f"compiled in the process vs loaded from the cache: {differ}"
