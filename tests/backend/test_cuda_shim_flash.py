"""The tensor-core prefill kernel (cuda/flash_attention_prefill.cu) on the CPU under tests/cuda_shim, against
paged_attention_ref, and which prefill kernel CUDABackend.paged_attention_prefill picks.

Launched through the real `CUDABackend` methods with the host launcher, whose mma.sync / ldmatrix /
cp.async follow PTX's fragment layouts (test_cuda_shim_mma.py).  Query counts and context offsets are
not multiples of the 64-row query tile, the 64- or 32-key tile or the KV block; GQA ratios 1, 3, 4, 7, 8;
every head dim the kernel is built for; sliding windows whose out-of-window blocks hold NaN (the kernel
must never read them).  The tolerance is the storage dtype's (reference_ops.TOL): P rounded to f16 /
bf16 before P V stays inside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda import kernel_specs as ks

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from reference_ops import assert_close, make_paged_batch, paged_attention_ref  # noqa: E402
from test_cuda_shim_attention import poison_out_of_window_blocks  # noqa: E402

HALF_TYPES = [np.float16, bfloat16]
HALF_IDS = ["f16", "bf16"]


@pytest.fixture
def backend(shim_libraries):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries))


def run_prefill(backend, dtype, heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window=0, seed=9):
    rng = np.random.default_rng(seed)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    if window:
        poison_out_of_window_blocks(paged, q_lens, block_size, window)
    out = np.zeros((paged[0].shape[0], heads * head_dim), dtype)
    backend.paged_attention(*paged, scale, out, max(q_lens), max(ctx_lens), window)
    return out, ref


CASES = [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths
    (4, 1, 16, 16, [5, 1, 20], [5, 8, 33]),          # the tiny models' D; a prompt, a decode row, a chunk
    (2, 2, 32, 8, [70], [70]),                        # two query tiles, the second of 6 rows; 2 key tiles
    (8, 1, 64, 16, [65, 3], [100, 3]),                # GQA 8; a chunk at offset 35; a tile of one row
    (4, 1, 96, 5, [17], [150]),                       # block size 5; offset 133, three key tiles
    (8, 2, 128, 16, [130, 1], [130, 77]),             # GQA 4, Llama's D: three query tiles beside a decode row
    (4, 1, 256, 32, [17, 40], [17, 107]),             # Gemma 3's D (32-key tiles, Q reloaded per k-step)
    (14, 2, 64, 16, [37, 1], [37, 50]),               # Qwen2.5-0.5B's G = 7: a query's heads straddle warps
]


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=HALF_IDS)
@pytest.mark.parametrize("case", CASES, ids=[f"flash{i}" for i in range(len(CASES))])
def test_flash_prefill_matches_reference(backend, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens = case
    out, ref = run_prefill(backend, dtype, heads, kv_heads, head_dim, block_size, q_lens, ctx_lens)
    name, grid, block, smem = backend._launcher.launches[-1]
    assert name == f"flash_attention_prefill_kernel<{ks.element_type(dtype)}, {head_dim}>"
    assert grid == (-(-max(q_lens) * (heads // kv_heads) // 64), kv_heads, len(q_lens)) and block == (128, 1, 1)
    assert smem == backend.flash_kv_tile(head_dim)[1]
    assert_close(out, ref, dtype, "flash prefill attention")


WINDOW_CASES = [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths, window
    (4, 1, 16, 16, [17, 3, 1], [17, 40, 30], 5),      # windows inside and across blocks, a decode row
    (2, 1, 64, 16, [130], [130], 24),                 # the window moves across three query tiles
    (2, 2, 32, 32, [70, 1, 3], [600, 600, 20], 512),  # chunks after a past longer than the window
    (4, 4, 128, 16, [33, 3], [33, 90], 1),            # W = 1: each query sees itself only
    (8, 1, 16, 16, [80, 5, 17], [150, 5, 100], 70),   # GQA 8; chunks mid-block, mid-window; W > a key tile
    (2, 1, 256, 16, [40], [90], 33),                  # D = 256 with its 32-key tiles
    (6, 2, 32, 16, [50, 2], [120, 9], 20),            # G = 3 does not divide the 64-row tile
]


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=HALF_IDS)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=[f"window{i}" for i in range(len(WINDOW_CASES))])
def test_flash_prefill_window(backend, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window = case
    out, ref = run_prefill(backend, dtype, heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window, seed=18)
    assert backend._launcher.launches[-1][0].startswith("flash_attention_prefill_kernel<")
    assert_close(out, ref, dtype, "flash prefill attention with a window")


def test_flash_prefill_agrees_with_the_fma_kernel(shim_libraries):
    """Both prefill kernels on one batch: the same attention within the dtype's tolerance of each other."""
    outs = []
    for flash in (True, False):
        backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
        backend.flash_prefill = flash
        out, ref = run_prefill(backend, bfloat16, 4, 2, 64, 16, [37, 2], [90, 50], seed=21)
        outs.append(out)
    assert_close(outs[0], outs[1].astype(np.float64), bfloat16, "flash vs FMA prefill")


@pytest.mark.parametrize("dtype,head_dim,flash,expected", [
    (np.float16, 64, True, "flash_attention_prefill_kernel"),
    (bfloat16, 128, True, "flash_attention_prefill_kernel"),
    (np.float32, 64, True, "paged_attention_prefill_kernel"),   # tensor cores take f16 / bf16 only
    (bfloat16, 80, True, "paged_attention_prefill_kernel"),     # no instance for D = 80
    (np.float16, 64, False, "paged_attention_prefill_kernel"),  # switched off
])
def test_prefill_kernel_selection(shim_libraries, dtype, head_dim, flash, expected):
    backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
    backend.flash_prefill = flash
    out, ref = run_prefill(backend, dtype, 2, 1, head_dim, 16, [9], [12])
    assert backend._launcher.launches[-1][0].split("<")[0] == expected
    assert_close(out, ref, dtype, "prefill attention")


def misaligned_copy(a: np.ndarray, modulus: int) -> np.ndarray:
    """A copy of a whose first element's address is not a multiple of `modulus` bytes."""
    buf = np.zeros(a.size + modulus, a.dtype)
    start = next(i for i in range(modulus) if (buf.ctypes.data + a.itemsize * i) % modulus)
    copy = buf[start:start + a.size].reshape(a.shape)
    copy[...] = a
    return copy


@pytest.mark.parametrize("which,modulus", [("k_cache", 16), ("qkv", 4)])
def test_misaligned_arrays_take_the_fma_kernel(backend, which, modulus):
    """cp.async moves 16 aligned bytes and Q / O move in aligned pairs: arrays off those alignments go to
    the other kernel, with the same result."""
    rng = np.random.default_rng(5)
    qkv, k_cache, v_cache, tables, ctx, qsl = make_paged_batch(rng, np.float16, [9], [12], 2, 1, 64, 16)
    ref = paged_attention_ref(qkv, k_cache, v_cache, tables, ctx, qsl, 0.125, 2)
    if which == "k_cache":
        k_cache = misaligned_copy(k_cache, modulus)
    else:
        qkv = misaligned_copy(qkv, modulus)
    out = np.zeros((9, 128), np.float16)
    backend.paged_attention(qkv, k_cache, v_cache, tables, ctx, qsl, 0.125, out, 9, 12)
    assert backend._launcher.launches[-1][0].startswith("paged_attention_prefill_kernel<")
    assert_close(out, ref, np.float16)


def test_flash_tiles_fit_shared_memory():
    for head_dim in ks.FLASH_HEAD_DIMS:
        tile, smem = CUDABackend.flash_kv_tile(head_dim)
        assert tile in (32, 64) and smem <= 48 * 1024


def test_gpu_attention_bench_runs_on_the_shim(shim_libraries):
    """tools/gpu_attention_bench.py, which a GPU session runs once with little time to spare: its whole
    path (inputs, both kernels, agreement, FLOP count, table) on a small shape with the host launcher."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "gpu_attention_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_attention_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.visible_pairs(2048, 0) == 2048 * 2049 // 2 and bench.visible_pairs(5, 2) == 1 + 2 * 4
    args = bench.parse(["--tokens", "70", "--heads", "4", "--kv-heads", "1", "--head-dim", "64", "--repeats", "1",
                       "--gemm", "32"])
    backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
    result = bench.run(backend, args, bench.host_timer)
    assert result["agree"], result
    names = [launch[0].split("<")[0] for launch in backend._launcher.launches]
    assert names[0] == "flash_attention_prefill_kernel" and names[-1] == "paged_attention_prefill_kernel"
    assert "TFLOP/s" in bench.table(result) and result["gemm_tflops"] > 0


@pytest.fixture(scope="module")
def tiny_mistral_bf16(tmp_path_factory):
    from conftest import _convert_tiny
    return _convert_tiny(tmp_path_factory, "tiny-mistral-swa", dtype="bfloat16")


def test_bf16_engine_steps_on_the_tensor_core_kernel(monkeypatch, tiny_mistral_bf16, staggered_generation):
    """The whole bf16 model on the CUDA backend (host shim), with the tiny Mistral's sliding window and
    GQA: prompts longer than a 64-row query tile go in chunks of 32 tokens beside decode rows (mixed
    steps).  Every prefill call of the engine runs the tensor-core kernel on the engine's own buffers, and
    each output is within the dtype's tolerance of the float64 reference.  (Greedy tokens are not compared
    with the FMA kernel's: this checkpoint's attention outputs reach 14, where one bf16 unit is 0.06, and
    its argmax margins are smaller than that.)"""
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig

    backend = CUDABackend(launcher=harness.ShimLauncher(harness.build_all()))
    real = backend.paged_attention_prefill
    checked = []

    def checked_prefill(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out,
                        max_query_len, window=0):
        real(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out, max_query_len, window)
        rows = int(query_start_loc[-1])
        ref = paged_attention_ref(qkv[:rows], k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                  out.shape[1] // k_cache.shape[3], window=window)
        assert_close(out[:rows], ref, bfloat16, f"engine step {list(query_start_loc)} / {list(context_lens)}")
        checked.append((backend._launcher.launches[-1][0], rows, window))
    backend.paged_attention_prefill = checked_prefill
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
    engine = LLMEngine(tiny_mistral_bf16, EngineConfig(device="cuda", kv_cache_memory="2MiB",
                                                       max_num_batched_tokens=32, max_num_seqs=4,
                                                       max_model_len=256, use_cuda_graphs=False, itl_target_ms=0))
    checked.clear()  # the warm-up's steps were checked too; count the requests' own
    out = staggered_generation(engine, {"a": list(range(3, 80)), "b": [5, 6, 7], "c": list(range(200, 290))}, 4)
    assert all(len(tokens) == 4 for tokens in out.values())
    assert checked and all(name == "flash_attention_prefill_kernel<bf16, 16>" for name, _, _ in checked)
    assert {window for _, _, window in checked} == {24} and max(rows for _, rows, _ in checked) == 32
