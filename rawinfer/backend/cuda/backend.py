"""CUDABackend: the op interface on an NVIDIA GPU, as CuPy RawKernels from cuda/*.cu plus cuBLAS GEMMs.

This module holds the backend itself: device memory and dtypes, the layer ops, cache maintenance and
CUDA graphs.  Three op families live in their own modules as parts the backend owns, each made with
the backend's `Launches` (launch.py) and what else it needs, and the backend forwards their ops to
them: paged attention (attention.py's `PagedAttention`: launch geometry, split-K scratch), token
selection (sampling.py's `DeviceSampling`) and the products with weight-only quantized matrices
(weight_only.py's `WeightOnlyProducts`).

Every op method checks shapes through backend/shapes.py (the contract both backends share), the
dtypes and layout only these kernels need here, and each argument against the kernel's signature
through `kernel_specs.pack_args`, then hands (kernel, grid, block, shared memory, arguments) to a
launcher (launch.py, runtime.py).  `CuPyLauncher` launches on the GPU; the test harness
tests/cuda_shim supplies a host launcher instead, so these very methods (geometry, checks, packing)
run in CI on NumPy arrays with the kernels compiled by g++.

Device dtypes.  Weights, KV cache and activations share one storage dtype: the model's (float32,
float16 or bfloat16), except the residual stream, which may be float32 (the pool keeps it so:
embedding, rmsnorm and add_rmsnorm take a second element type R for it); every kernel computes in
float32.  CuPy has no bfloat16, so a bfloat16 tensor lives on the device as uint16 bit patterns:
`carve`, `upload` and `to_host` translate, and no other uint16 device array exists in this backend.
`linear` may write float32 output from 16-bit inputs (for logits).  int8 and fp8 weight-only models run
here (weight_only.py); q4 models do not (the engine refuses them at start: Capabilities.quantized_weights).

GEMM convention, stated once.  rawinfer stores matrices row-major: x[T, K], w[N, K] (out features x in
features), out[T, N], and computes out = x @ w^T.  cuBLAS reads column-major, and a row-major [r, c]
buffer IS the column-major [c, r] matrix.  So cuBLAS sees w as w^T [K, N] (lda = K), x as x^T [K, T]
(ldb = K), out as out^T [N, T] (ldc = N), and out^T = w @ x^T is

    gemmEx(transa=T, transb=N, m=N, n=T, k=K, A=w, lda=K, B=x, ldb=K, C=out, ldc=N)

in float32 accumulation (CUBLAS_COMPUTE_32F; tensor cores for fp16/bf16 inputs).

CUDA graphs.  `capture_graph(fn)` runs fn once eagerly, then has the launcher record its launches
(runtime.py states the rules fn must follow); `graph.replay()` re-issues them.  The decode
split-K scratch must be bound first (`bind_attention_workspace`, a carve of the pool sized by
`attention_workspace_bytes`), and fn must pass a fixed max_context_len (the model runner passes the
longest context the engine allows) so the decode grid does not change between steps.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.base import Backend, Capabilities
from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.attention import PagedAttention
from rawinfer.backend.cuda.launch import Launches, address, round_up, row_threads
from rawinfer.backend.cuda.runtime import (CUDAGraph, CuPyLauncher, cuda_available, cuda_status,  # noqa: F401
                                           kernel_source)
from rawinfer.backend.cuda.sampling import DeviceSampling
from rawinfer.backend.cuda.weight_only import WeightOnlyProducts
from rawinfer.quant import Fp8Weight, Int8Weight, Q4Weight

WEIGHT_ONLY = (Int8Weight, Fp8Weight)   # the quantized matrices weight_only.py multiplies
HEAD_RMSNORM_HEADS_PER_BLOCK = 4   # HEADS_PER_BLOCK in cuda/head_rmsnorm.cu: one warp per head
FUSED_HEADS_PER_BLOCK = 4          # FUSED_HEADS_PER_BLOCK in cuda/fused_rope_kv_write.cu: one warp per head

try:
    from ml_dtypes import bfloat16 as _BF16
except ImportError:  # pragma: no cover
    _BF16 = None


def _attention_setting(name: str) -> property:
    """A backend attribute that reads and writes the attention part's tuning attribute `name` (tests and
    tools/gpu_decode_bench.py set them on the backend)."""
    return property(lambda self: getattr(self.attention, name),
                    lambda self, value: setattr(self.attention, name, value),
                    doc=f"PagedAttention.{name} of this backend's attention part")


class CUDABackend(Backend):
    """The op interface on one CUDA device (or, with a test launcher, on the host through tests/cuda_shim).
    It owns its op families' parts: `attention` (PagedAttention), `sampling` (DeviceSampling) and
    `weight_only` (WeightOnlyProducts), all launching through its one `launches` (Launches)."""

    name = "cuda"
    decode_partition = _attention_setting("decode_partition")
    decode_min_partition = _attention_setting("decode_min_partition")
    decode_target_splits = _attention_setting("decode_target_splits")
    decode_heads_per_pass = _attention_setting("decode_heads_per_pass")
    flash_prefill = _attention_setting("flash_prefill")

    def __init__(self, launcher: Any = None, *, device_id: int = 0, decode_partition: int = 512):
        """launcher None: the GPU (CuPy).  Otherwise an object with launch()/gemm() like CuPyLauncher,
        and arrays are NumPy arrays (the host shim of the tests).  decode_partition: the longest split
        of a sequence's context in the decode kernel, in positions (whole KV blocks; attention.py sizes each
        sequence's splits from its own context, between decode_min_partition and this)."""
        if launcher is None:
            usable, why = cuda_status()
            if not usable:
                raise RuntimeError(f"the CUDA backend cannot start: {why}; use --device cpu instead")
            import cupy
            cupy.cuda.Device(device_id).use()
            self.xp = cupy
            launcher = CuPyLauncher()
        else:
            self.xp = np
        self.launches = Launches(launcher)
        self.attention = PagedAttention(self.launches, self.xp, decode_partition=decode_partition)
        self.sampling = DeviceSampling(self.launches, self.xp)
        self.weight_only = WeightOnlyProducts(self.launches, self.xp)
        self.capabilities = Capabilities(on_gpu=self.on_gpu, graphs=self.supports_graphs, device_sampling=True,
                                         quantized_weights=("int8", "fp8"))

    @property
    def on_gpu(self) -> bool:
        return self.xp is not np

    @property
    def _launcher(self) -> Any:
        """The launcher under `launches` (the tests read the shim launcher's record of launches)."""
        return self.launches.launcher

    def _launch(self, kernel: str, targs: tuple[str, ...], grid, block, shared_mem: int, *args) -> None:
        """Launches.launch: how the layer ops below put a kernel on the device."""
        self.launches.launch(kernel, targs, grid, block, shared_mem, *args)

    def _refuse_q4(self, w) -> None:
        if isinstance(w, Q4Weight):
            raise ValueError(f"q4 weight-only models run on the CPU backend; convert {self.capabilities.conversions()} "
                             "for --device cuda")

    # ---- memory ---------------------------------------------------------------------------------
    def storage_dtype(self, dtype) -> np.dtype:
        """The dtype an array of logical dtype `dtype` has in this backend's memory (bf16 -> uint16 on GPU)."""
        dtype = np.dtype(dtype)
        if self.on_gpu and _BF16 is not None and dtype == np.dtype(_BF16):
            return np.dtype(np.uint16)
        return dtype

    def alloc_arena(self, nbytes: int):
        if not self.on_gpu:
            return np.empty(nbytes, np.uint8)
        cp = self.xp
        memory = cp.cuda.Memory(nbytes)  # one cudaMalloc, outside CuPy's caching pool
        return cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))

    def carve(self, arena, offset: int, shape: tuple[int, ...], dtype):
        return super().carve(arena, offset, shape, self.storage_dtype(dtype))

    def empty(self, shape, dtype):
        """A fresh device array (tests, workspaces): not for the serving path, which carves the pool."""
        return self.xp.empty(shape, self.storage_dtype(dtype))

    def device_memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, for sizing the pool."""
        if not self.on_gpu:
            raise RuntimeError("device_memory_info needs the GPU")
        free, total = self.xp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def upload(self, dst, src: np.ndarray) -> None:
        host = np.asarray(src)
        if tuple(host.shape) != tuple(dst.shape):
            raise ValueError(f"upload: source shape {host.shape} does not match destination {tuple(dst.shape)}")
        if self.on_gpu and dst.dtype == np.uint16 and host.dtype != np.uint16:
            host = host.astype(_BF16).view(np.uint16)   # bfloat16 travels as its bits
        host = np.ascontiguousarray(host, dtype=dst.dtype)
        if self.on_gpu:
            dst.set(host)
        else:
            dst[...] = host

    def to_host(self, x) -> np.ndarray:
        if not self.on_gpu:
            return np.asarray(x)
        host = self.xp.asnumpy(x)
        return host.view(_BF16) if host.dtype == np.uint16 else host

    def kv_blocks_to_host(self, kv, block_ids: list[int]) -> list[np.ndarray]:
        """The base method's arrays, on the GPU through page-locked memory: each layer's K and V blocks are
        gathered into one device buffer (reused for every layer) and copied into a single pinned host
        buffer for all layers, a DMA at the link's speed where pageable memory is copied twice. The
        arrays are views of that buffer; it lives as long as any of them (the socket sending them)."""
        if not self.on_gpu:
            return super().kv_blocks_to_host(kv, block_ids)
        cp = self.xp
        import cupyx
        ids = cp.asarray(block_ids, dtype=cp.int64)
        tile = tuple(kv.k[0].shape[1:])
        dev = cp.empty((2, len(block_ids)) + tile, dtype=kv.k[0].dtype)
        host = cupyx.empty_pinned((len(kv.k),) + dev.shape, dtype=dev.dtype)
        for layer in range(len(kv.k)):
            cp.take(kv.k[layer], ids, axis=0, out=dev[0])
            cp.take(kv.v[layer], ids, axis=0, out=dev[1])
            dev.get(out=host[layer])                      # on the current stream, after the step's kernels
        return list(host)

    def synchronize(self) -> None:
        if self.on_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def weight_dtype(self, model_dtype: str) -> np.dtype:
        return {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(_BF16)}[model_dtype]

    def kv_dtype(self, model_dtype: str, choice: str = "auto", quant: str | None = None) -> np.dtype:
        if choice not in ("auto", model_dtype):
            raise ValueError(f"kv_cache_dtype={choice!r}: the CUDA kernels keep K/V in the model's dtype "
                             f"({model_dtype}); use kv_cache_dtype='auto' (--kv-cache-dtype auto) on CUDA")
        return self.weight_dtype(model_dtype)

    def activation_dtype(self, model_dtype: str) -> np.dtype:
        return self.weight_dtype(model_dtype)

    def as_index_array(self, host: np.ndarray):
        return self.xp.asarray(np.ascontiguousarray(host, dtype=np.int32))

    # ---- layer ops ------------------------------------------------------------------------------
    def embedding(self, ids, table, out, scale: float = 1.0) -> None:
        """out = table[ids] * scale, the product in float32 (scale 1 copies the rows exactly); an int8 or
        fp8 table's rows are dequantized (weight_only.py)."""
        if isinstance(table, WEIGHT_ONLY):
            self.weight_only.embedding(ids, table, out, scale)
            return
        self._refuse_q4(table)
        n, hidden = shapes.embedding(ids, table.shape, out)
        if n:
            self._launch("embedding_kernel", (ks.element_type(table.dtype), ks.element_type(out.dtype)), (n,),
                         (row_threads(hidden),), 0, out, ids, table, hidden, scale)

    def rmsnorm(self, x, weight, eps: float, out) -> None:
        n, hidden = shapes.norm("rmsnorm", x, weight, out)
        if n:
            self._launch("rmsnorm_kernel", (ks.element_type(weight.dtype), ks.element_type(x.dtype)), (n,),
                         (row_threads(hidden),), 0, out, x, weight, hidden, eps)

    def add_rmsnorm(self, x, residual, weight, eps: float, out) -> None:
        n, hidden = shapes.norm("add_rmsnorm", x, weight, out, residual)
        if n:
            self._launch("add_rmsnorm_kernel", (ks.element_type(weight.dtype), ks.element_type(residual.dtype)),
                         (n,), (row_threads(hidden),), 0, out, residual, x, weight, hidden, eps)

    def norm_add_rmsnorm(self, x, x_weight, residual, weight, eps: float, out) -> None:
        """One pass (rmsnorm.cu's norm_add_rmsnorm_kernel); x is only read."""
        n, hidden = shapes.norm("norm_add_rmsnorm", x, weight, out, residual)
        if tuple(x_weight.shape) != (hidden,):
            raise shapes.shape_error("norm_add_rmsnorm", "x_weight", x_weight.shape, f"(C,) = ({hidden},)")
        if n:
            self._launch("norm_add_rmsnorm_kernel", (ks.element_type(weight.dtype), ks.element_type(residual.dtype)),
                         (n,), (row_threads(hidden),), 0, out, residual, x, x_weight, weight, hidden, eps)

    def linear(self, x, w, out, bias=None, scratch=None) -> None:
        """out[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]) through cuBLAS (the call in the module docstring).
        An Int8Weight or Fp8Weight goes to weight_only.py, whose GEMM path dequantizes tiles of it into
        `scratch`."""
        if isinstance(w, WEIGHT_ONLY):
            self.weight_only.linear(x, w, out, bias, scratch)
            return
        self._refuse_q4(w)
        n, k, n_out = shapes.linear(x, tuple(w.shape), out, bias)
        # cuBLAS takes raw pointers, so what pack_args checks for a kernel is checked here.
        if x.dtype != w.dtype or out.dtype not in (x.dtype, np.dtype(np.float32)):
            raise ValueError(f"linear: x ({x.dtype}) and w ({w.dtype}) must share a dtype and out ({out.dtype}) "
                             "must have it too or be float32")
        if bias is not None and bias.dtype != out.dtype:
            raise ValueError(f"linear: bias ({bias.dtype}) must have out's dtype ({out.dtype})")
        for name, a in (("x", x), ("w", w), ("out", out)):
            if not a.flags.c_contiguous:
                raise ValueError(f"linear: {name} must be C-contiguous")
        if n == 0:
            return
        beta = 0.0
        if bias is not None:
            out[...] = bias[None, :]   # a plain copy of bits: exact for uint16-stored bf16 too
            beta = 1.0
        self.launches.gemm(True, False, n_out, n, k, w, k, x, k, out, n_out, beta)

    def rope(self, qkv, positions, cos_sin, num_heads: int, num_kv_heads: int) -> None:
        n, head_dim = shapes.rope(qkv, positions, cos_sin, num_heads, num_kv_heads)
        if n:
            pairs = (num_heads + num_kv_heads) * head_dim // 2   # rotated (i, i + D/2) pairs of one row
            self._launch("rope_kernel", (ks.element_type(qkv.dtype),), (n,), (row_threads(pairs),), 0,
                         qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim)

    def head_rmsnorm(self, qkv, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int) -> None:
        """One warp per q or k head of a token: grid (T, ceil((H + Hkv) / 4)), 4 warps a block."""
        n, head_dim = shapes.head_rmsnorm(qkv, q_weight, k_weight, num_heads, num_kv_heads)
        if n:
            heads = num_heads + num_kv_heads
            self._launch("head_rmsnorm_kernel", (ks.element_type(qkv.dtype),),
                         (n, -(-heads // HEAD_RMSNORM_HEADS_PER_BLOCK)), (32 * HEAD_RMSNORM_HEADS_PER_BLOCK,), 0,
                         qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps)

    def silu_mul(self, gate_up, out) -> None:
        self._gated_activation("silu_mul", gate_up, out)

    def gelu_tanh_mul(self, gate_up, out) -> None:
        self._gated_activation("gelu_tanh_mul", gate_up, out)

    def _gated_activation(self, op: str, gate_up, out) -> None:
        """out[T, F] = act(gate_up[:, :F]) * gate_up[:, F:] with the kernel <op>_kernel of silu_mul.cu."""
        n, ffn = shapes.silu_mul(gate_up, out, op=op)
        if n:
            threads = min(256, round_up(ffn, 32))
            self._launch(f"{op}_kernel", (ks.element_type(out.dtype),), (n, -(-ffn // threads)), (threads,), 0,
                         out, gate_up, ffn)

    def kv_write(self, qkv, k_cache, v_cache, slot_mapping, num_heads: int) -> None:
        n, num_kv_heads, head_dim = shapes.kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)
        if n:
            self._launch("kv_write_kernel", (ks.element_type(qkv.dtype),), (n,),
                         (row_threads(num_kv_heads * head_dim),), 0, k_cache, v_cache, qkv, slot_mapping,
                         num_heads, num_kv_heads, head_dim, k_cache.shape[2])

    def fused_rope_kv_write(self, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads: int,
                            num_kv_heads: int, q_norm=None, k_norm=None, eps: float = 0.0) -> None:
        """fused_rope_kv_write.cu: one warp per q, k or v head of a token, grid (T, ceil((H + 2Hkv) / 4))."""
        n, head_dim = shapes.rope(qkv, positions, cos_sin, num_heads, num_kv_heads)
        _, cache_heads, _ = shapes.kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)
        if cache_heads != num_kv_heads:
            raise shapes.shape_error("fused_rope_kv_write", "k_cache", k_cache.shape,
                                     f"(NB, Hkv, BS, D) with Hkv = {num_kv_heads}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("fused_rope_kv_write: give both q_norm and k_norm (qk_norm) or neither")
        norm = () if q_norm is None else (q_norm, k_norm)
        if norm:
            shapes.head_rmsnorm(qkv, q_norm, k_norm, num_heads, num_kv_heads)
        if n:
            grid = (n, -(-(num_heads + 2 * num_kv_heads) // FUSED_HEADS_PER_BLOCK))
            kernel = "fused_norm_rope_kv_write_kernel" if norm else "fused_rope_kv_write_kernel"
            self._launch(kernel, (ks.element_type(qkv.dtype),), grid, (32 * FUSED_HEADS_PER_BLOCK,), 0,
                         qkv, k_cache, v_cache, *norm, positions, cos_sin, slot_mapping, num_heads, num_kv_heads,
                         head_dim, k_cache.shape[2], *((eps,) if norm else ()))

    # ---- paged attention: attention.py's PagedAttention -----------------------------------------
    def paged_attention_decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               scale: float, out, max_context_len: int, window: int = 0) -> None:
        self.attention.decode(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out,
                              max_context_len, window)

    def paged_attention_prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale: float, out, max_query_len: int, window: int = 0) -> None:
        self.attention.prefill(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out,
                               max_query_len, window)

    def attention_workspace_bytes(self, max_num_seqs: int, num_heads: int, head_dim: int, block_size: int,
                                  max_context_len: int, itemsize: int, num_kv_heads: int) -> int:
        return self.attention.attention_workspace_bytes(max_num_seqs, num_heads, head_dim, block_size,
                                                        max_context_len, itemsize, num_kv_heads)

    def bind_attention_workspace(self, buffer) -> None:
        self.attention.bind_attention_workspace(buffer)

    # the decode split arithmetic and the prefill path, which tests and tools/gpu_*_bench.py ask the backend for
    def decode_split_range(self, group: int, head_dim: int, block_size: int, itemsize: int) -> tuple[int, int]:
        return self.attention.decode_split_range(group, head_dim, block_size, itemsize)

    def decode_split_len(self, span: int, block_size: int, split_range: tuple[int, int]) -> int:
        return self.attention.decode_split_len(span, block_size, split_range)

    def decode_splits(self, bound: int, split_range: tuple[int, int]) -> int:
        return self.attention.decode_splits(bound, split_range)

    def uses_flash_prefill(self, qkv, k_cache, v_cache, out, head_dim: int) -> bool:
        return self.attention.uses_flash_prefill(qkv, k_cache, v_cache, out, head_dim)

    prefill_kv_tile = staticmethod(PagedAttention.prefill_kv_tile)
    flash_kv_tile = staticmethod(PagedAttention.flash_kv_tile)

    # ---- token selection: sampling.py's DeviceSampling -----------------------------------------
    def argmax(self, logits) -> np.ndarray:
        return self.to_host(self.sampling.argmax(logits)).astype(np.int64)

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform) -> np.ndarray:
        return self.to_host(self.sampling.sample(logits, temperature, top_k, top_p, min_p, uniform)).astype(np.int64)

    def grammar_mask(self, logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
        self.sampling.grammar_mask(logits, bitmask, rows)

    # ---- cache maintenance and gathers ----------------------------------------------------------
    def copy_blocks(self, k_caches, v_caches, pairs: list[tuple[int, int]]) -> None:
        """One launch for every layer: grid (pairs, L), each block copies one block of one layer's K and
        V, addressed through tables of the layers' cache pointers."""
        if not pairs:
            return
        if len(k_caches) != len(v_caches) or not k_caches:
            raise ValueError("copy_blocks: k_caches and v_caches must be equally long, non-empty lists of layers")
        shape = shapes.caches("copy_blocks", k_caches[0], v_caches[0])
        for k, v in zip(k_caches, v_caches):
            if shapes.caches("copy_blocks", k, v) != shape or k.dtype != k_caches[0].dtype:
                raise ValueError("copy_blocks: every layer's cache must have the same shape and dtype")
        num_blocks = shape[0]
        table = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if table.min() < 0 or table.max() >= num_blocks:
            raise ValueError(f"copy_blocks: block ids must be in [0, {num_blocks}), got {pairs}")
        if len(set(table[:, 1].tolist())) != len(table) or set(table[:, 1].tolist()) & set(table[:, 0].tolist()):
            raise ValueError("copy_blocks: every destination block must appear once and never as a source")
        block_bytes = shape[1] * shape[2] * shape[3] * np.dtype(k_caches[0].dtype).itemsize
        k_ptrs = self.xp.asarray(np.array([address(k) for k in k_caches], np.uint64))
        v_ptrs = self.xp.asarray(np.array([address(v) for v in v_caches], np.uint64))
        dev_pairs = self.xp.asarray(table.astype(np.int32))
        self._launch("copy_blocks_kernel", (), (len(table), len(k_caches)), (256,), 0,
                     k_ptrs, v_ptrs, dev_pairs, block_bytes // 4)

    def take_rows(self, x, indices, out) -> None:
        n, cols = shapes.take_rows(x, indices, out)
        if n:
            self._launch("take_rows_kernel", (ks.element_type(x.dtype),), (n,), (row_threads(cols),), 0,
                         out, x, indices, cols)

    # ---- CUDA graphs ----------------------------------------------------------------------------
    @property
    def supports_graphs(self) -> bool:
        """True when the launcher can capture graphs (the GPU's can; a test launcher may)."""
        return callable(getattr(self.launches.launcher, "capture", None))

    def capture_graph(self, fn: Callable[[], None]) -> CUDAGraph:
        """Run fn eagerly once (compiles everything, warms cuBLAS; its results are real results), then
        capture it as a graph whose replay() repeats it on whatever its input buffers then hold."""
        if not self.supports_graphs:
            raise RuntimeError("this backend's launcher cannot capture CUDA graphs; run without CUDA graphs")
        fn()
        self.synchronize()
        return self.launches.launcher.capture(fn)
