"""int8 weight-only products on CUDA (cuda/weight_only_linear.cu, cuda/weight_only_embedding.cu,
backend/cuda/weight_only.py), on the host shim (no GPU), against NumPy references and against the CPU backend;
tiny fp8 models and fp8 embedding tables too (the kernels' e4m3 instances; more of them in test_cuda_fp8.py).

The kernels run through the real `CUDABackend` methods (`linear`, `linear_silu_mul`, `embedding`) with
the shim's launcher: decode rows (1..8) take the GEMV kernel, more rows the dequantized tiles + the GEMM.
Shapes are ragged: N not a multiple of the 4 output rows of a block, K a multiple of 16 with a chunk count
not a multiple of the warp (the vector path) and K not a multiple of 16 (the element path).  Tolerances:
two units in the last place of the output dtype (reference_ops.TOL), relative to max(1, |ref|).  The
engine test runs tiny int8 models on the CUDA backend over the shim and on the CPU backend.
"""

from __future__ import annotations


import numpy as np
import pytest

harness = pytest.importorskip("cuda_shim.harness")
if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402

from rawinfer import LLMEngine  # noqa: E402
from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from rawinfer.backend.cuda.weight_only import WO_GEMV_MAX_ROWS  # noqa: E402
from rawinfer.config import EngineConfig  # noqa: E402
from rawinfer.quant import Fp8Weight, Int8Weight, Q4Weight  # noqa: E402
from reference_ops import (assert_close, f64, int8_linear_ref, linear_ref, rand, random_weight_only,  # noqa: E402
                           silu_mul_ref, weight_only_values)

ACT_DTYPES = [np.float16, bfloat16, np.float32]
ACT_IDS = ["f16", "bf16", "f32"]
# (N, K): N % 4 != 0; K / 16 = 3 and 33 chunks (fewer than and not a multiple of the 32 lanes); K = 100
# and 7 are no multiple of 16 (the element-by-element path)
SHAPES = [(13, 48), (70, 528), (37, 100), (5, 7)]


@pytest.fixture
def backend(shim_libraries):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries))


WEIGHT_CLASSES = {"int8": Int8Weight, "fp8": Fp8Weight}


def int8_weight(rng, n, k) -> Int8Weight:
    return Int8Weight(*random_weight_only(rng, n, k, "int8"))


def dequantized(w: Int8Weight, dtype) -> np.ndarray:
    """q * scale as wo_dequant_kernel writes it: the float32 product rounded once to dtype."""
    return (w.q.astype(np.float32) * w.scale[:, None]).astype(dtype)


def kernels_run(backend) -> list[str]:
    return [name for name, *_ in backend._launcher.launches]


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_IDS)
@pytest.mark.parametrize("n_out,k", SHAPES)
def test_gemv_decode_rows(backend, dtype, n_out, k):
    """Every row count of the GEMV kernel, out in x's dtype and in float32 (logits), with and without bias."""
    rng = np.random.default_rng(n_out * 1000 + k)
    w = int8_weight(rng, n_out, k)
    for rows in range(1, WO_GEMV_MAX_ROWS + 1):
        x = rand(rng, (rows, k), dtype)
        for out_dtype in {np.dtype(dtype), np.dtype(np.float32)}:
            bias = rand(rng, (n_out,), out_dtype) if rows % 2 else None
            out = np.full((rows, n_out), np.nan, out_dtype)
            backend._launcher.launches.clear()
            backend.linear(x, w, out, bias=bias)
            assert kernels_run(backend) == [f"wo_gemv_kernel<signed char, {_ct(dtype)}, {_ct(out_dtype)}>"]
            assert_close(out, int8_linear_ref(x, w.q, w.scale, bias), out_dtype,
                         f"gemv rows={rows} out={out_dtype} bias={bias is not None}")


def _ct(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float16): "f16", np.dtype(bfloat16): "bf16"}[np.dtype(dtype)]


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_IDS)
@pytest.mark.parametrize("n_out,k", SHAPES[:3])
@pytest.mark.parametrize("rows", [9, 23])
def test_prefill_rows_take_dequantized_tiles(backend, dtype, n_out, k, rows):
    """More rows than the GEMV serves: tiles of weight rows dequantized into the scratch (several tiles:
    the scratch holds 5 rows of K floats, so 10 rows of a 16-bit dtype), each multiplied by the GEMM
    into its columns of out. Equal to the GEMM of the dequantized matrix; within the format's error of
    the exact int8 product."""
    rng = np.random.default_rng(rows * 7 + k)
    w = int8_weight(rng, n_out, k)
    x = rand(rng, (rows, k), dtype)
    scratch = np.zeros(5 * k, np.float32)
    tile_rows = 5 * 4 // np.dtype(dtype).itemsize
    for out_dtype in {np.dtype(dtype), np.dtype(np.float32)}:
        for bias in (None, rand(rng, (n_out,), out_dtype)):
            out = np.full((rows, n_out), np.nan, out_dtype)
            backend._launcher.launches.clear()
            backend.linear(x, w, out, bias=bias, scratch=scratch)
            assert kernels_run(backend).count(f"wo_dequant_kernel<signed char, {_ct(dtype)}>") == -(-n_out // tile_rows)
            assert_close(out, linear_ref(x, dequantized(w, dtype), bias), out_dtype, "tiled int8 GEMM")
            exact = int8_linear_ref(x, w.q, w.scale, bias)
            weight_error = 2.0**-8 if np.dtype(dtype) == np.dtype(bfloat16) else 2.0**-10   # the tile's rounding
            bound = weight_error * (f64(np.abs(x)) @ f64(np.abs(w.q)).T * f64(w.scale)) + 4 * 2.0**-8
            assert np.all(np.abs(f64(out) - exact) <= bound + np.abs(exact) * 2.0**-7)
    # without a scratch (a direct call, not the engine's): one tile of the whole matrix
    out = np.zeros((rows, n_out), np.float32)
    backend.linear(x, w, out)
    assert_close(out, linear_ref(x, dequantized(w, dtype)), np.float32, "untiled")


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_IDS)
def test_dequant_kernel_rounds_once(backend, dtype):
    rng = np.random.default_rng(3)
    w = int8_weight(rng, 6, 77)
    out = np.zeros((6, 77), dtype)
    backend._launch("wo_dequant_kernel", ("signed char", _ct(dtype)), (6,), (32,), 0, out, w.q, w.scale, 77)
    np.testing.assert_array_equal(f64(out), f64(dequantized(w, dtype)))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("rows", [2, 12])
def test_linear_silu_mul_with_an_int8_gate_up(backend, dtype, rows):
    rng = np.random.default_rng(rows)
    k, ffn = 64, 24
    w = int8_weight(rng, 2 * ffn, k)
    x = rand(rng, (rows, k), dtype)
    gate_up, out = np.zeros((rows, 2 * ffn), dtype), np.zeros((rows, ffn), dtype)
    backend.linear_silu_mul(x, w, gate_up, out, scratch=np.zeros(2 * ffn * k, np.float32))
    want_gate_up = np.zeros_like(gate_up)
    backend.linear(x, w, want_gate_up, scratch=np.zeros(2 * ffn * k, np.float32))
    assert_close(out, silu_mul_ref(want_gate_up), dtype, "linear_silu_mul")


@pytest.mark.parametrize("fmt", list(WEIGHT_CLASSES))
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("hidden", [70, 16])
def test_int8_embedding_dequantizes_the_gathered_rows(backend, out_dtype, hidden, fmt):
    """int8 and fp8 tables (the e4m3 instance of the same kernel)."""
    rng = np.random.default_rng(hidden)
    table = WEIGHT_CLASSES[fmt](*random_weight_only(rng, 50, hidden, fmt))
    ids = rng.integers(0, 50, 9).astype(np.int32)
    for scale in (1.0, float(np.sqrt(hidden))):
        out = np.zeros((9, hidden), out_dtype)
        backend.embedding(ids, table, out, scale)
        rows = weight_only_values(table.q[ids]) * table.scale[ids, None] * np.float32(scale)  # the CPU's order
        if np.dtype(out_dtype) == np.float32:
            np.testing.assert_array_equal(out, rows)
        else:
            np.testing.assert_array_equal(f64(out), f64(rows.astype(out_dtype)))


def test_bad_int8_arguments_are_refused_by_name(backend):
    rng = np.random.default_rng(4)
    w = int8_weight(rng, 8, 32)
    x = rand(rng, (2, 32), np.float16)
    with pytest.raises(ValueError, match="out .* must have x's dtype"):
        backend.linear(x, w, np.zeros((2, 8), bfloat16))
    with pytest.raises(ValueError, match="scale"):
        backend.linear(x, Int8Weight(w.q, w.scale[:4]), np.zeros((2, 8), np.float16))
    with pytest.raises(ValueError, match="scratch holds"):
        backend.linear(rand(rng, (12, 32), np.float16), w, np.zeros((12, 8), np.float16),
                       scratch=np.zeros(7, np.float32))
    q4 = Q4Weight(np.zeros((8, 32), np.uint8), np.zeros((8, 2, 2), np.float16))
    with pytest.raises(ValueError, match="q4 weight-only models run on the CPU backend"):
        backend.linear(rand(rng, (2, 64), np.float32), q4, np.zeros((2, 8), np.float32))
    assert backend.capabilities.quantized_weights == ("int8", "fp8")


# ---- the whole model ---------------------------------------------------------------------------------
PROMPTS = {"a": [5, 6, 7], "b": list(range(20, 47)), "c": [300, 301, 9, 11, 40, 41]}


def shim_engine(monkeypatch, model_dir, libraries) -> tuple[LLMEngine, list]:
    """The CUDA engine on the shim, and the list its runner appends every step's logits to."""
    backend = CUDABackend(launcher=harness.ShimLauncher(libraries))
    with monkeypatch.context() as patch:     # only this engine: the CPU engine it is compared with gets its own
        patch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
        engine = LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * 1024**2,
                                                   max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128,
                                                   itl_target_ms=0, warmup=False))
    return engine, _recording(engine)


def cpu_engine(model_dir) -> LLMEngine:
    """The CPU backend on the same int8 (or fp8) file, with what CUDA does elsewhere: float32 K/V (an int8
    model's CPU default is an int8 cache) and float activations in the products (no integer GEMM); the CPU
    runs an fp8 file as float32 weights dequantized at load (its reference path)."""
    engine = LLMEngine(model_dir, device="cpu", kv_cache_memory="2MiB", max_num_batched_tokens=16, max_num_seqs=4,
                       max_model_len=128, itl_target_ms=0, warmup=False, kv_cache_dtype="float32",
                       cpu_int_gemm=False)
    assert engine.backend.name == "cpu"
    return engine


def _recording(engine) -> list:
    logits, run = [], engine.runner.run

    def recording_run(plan):
        out = run(plan)
        logits.append(np.array(out.logits, dtype=np.float32))
        return out
    engine.runner.run = recording_run
    return logits


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_int8_model_on_cuda_gives_the_cpu_backends_tokens(monkeypatch, tmp_path_factory, shim_libraries,
                                                                 staggered_generation, name, quant):
    """float32 activations, int8 (or fp8 e4m3) weights: the same greedy tokens as the CPU backend on the same
    file, and every step's logits within float32 rounding of the CPU's. Prompt chunks of 16 rows take the
    dequantized tiles, decode steps (1 to 3 rows) and the 3-token prompt the GEMV; Qwen2 adds the QKV
    bias; the LM head is the quantized embedding table (tied)."""
    from conftest import _convert_tiny
    model_dir = _convert_tiny(tmp_path_factory, name, quant=quant)
    engine, logits = shim_engine(monkeypatch, model_dir, shim_libraries)
    launches = engine.backend._launcher.launches
    got = staggered_generation(engine, PROMPTS, 6)
    kernels = {name.split("<")[0] for name, *_ in launches}
    assert {"wo_gemv_kernel", "wo_dequant_kernel", "wo_embedding_kernel"} <= kernels
    cpu = cpu_engine(model_dir)
    cpu_logits = _recording(cpu)
    assert staggered_generation(cpu, PROMPTS, 6) == got
    assert len(cpu_logits) == len(logits)
    for a, b in zip(logits, cpu_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_tiny_bf16_int8_model_on_cuda_stays_within_the_formats_error(monkeypatch, tmp_path_factory, shim_libraries,
                                                                      quant):
    """bf16 activations with int8 (or fp8) weights against the CPU backend (float32 activations) on the same file:
    the logits within a bound stated relative to bf16 (8 units of its rounding, 2^-8, times the logits'
    scale: under twice the difference the same model converted without --quant shows between the two
    backends, docs/gpu-kernels.md), the greedy tokens equal where the CPU's top-2 margin exceeds twice it."""
    from conftest import _convert_tiny
    model_dir = _convert_tiny(tmp_path_factory, "tiny-llama", dtype="bfloat16", quant=quant)
    engine, _ = shim_engine(monkeypatch, model_dir, shim_libraries)
    assert engine.pool.workspace.acts.hidden.dtype == np.dtype(bfloat16)
    prompt = list(range(20, 47))
    chunks = [16] + [1] * (len(prompt) - 16)      # a prefill chunk (the tiles + GEMM), then decode rows (GEMV)
    got = engine.score(prompt, chunks)
    want = cpu_engine(model_dir).score(prompt, chunks)
    bound = 8 * 2.0**-8 * float(np.abs(want).max())
    assert np.abs(np.asarray(got, np.float64) - want).max() <= bound
    top2 = np.sort(want, axis=-1)[:, -2:]
    sure = top2[:, 1] - top2[:, 0] > 2 * bound
    assert sure.sum() >= 3
    np.testing.assert_array_equal(np.argmax(got, -1)[sure], np.argmax(want, -1)[sure])


def test_int8_decode_graphs_replay_the_eager_steps(monkeypatch, tmp_path_factory, shim_libraries):
    """Ten sequences decoding together take the 16-row bucket: the dequantized tiles + GEMM inside a
    captured graph (and the GEMV in the smaller buckets) give the eager engine's greedy tokens."""
    from rawinfer import SamplingParams
    from conftest import _convert_tiny
    model_dir = _convert_tiny(tmp_path_factory, "tiny-llama", quant="int8")
    results, launchers = [], []
    for graphs in (True, False):
        launcher = harness.CapturingShimLauncher(shim_libraries)
        backend = CUDABackend(launcher=launcher)
        with monkeypatch.context() as patch:
            patch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
            engine = LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * 1024**2,
                                                       max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64,
                                                       use_cuda_graphs=graphs, itl_target_ms=0, warmup=False))
        assert (engine.runner.graphs is not None) == graphs
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out = {str(i): [] for i in range(10)}
        for i in range(10):
            engine.add_request(str(i), [5 + i, 6, 7 + 2 * i], params)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        results.append(out)
        launchers.append(launcher)
    assert results[0] == results[1]
    assert launchers[0].replays and not launchers[1].replays
    gemm_kernels = [name for name, *_ in launchers[1].launches if name.startswith("wo_dequant_kernel")]
    assert gemm_kernels     # the eager decode steps of 10 rows took the tiles too
