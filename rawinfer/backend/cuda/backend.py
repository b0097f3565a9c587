"""CUDABackend: the op interface on an NVIDIA GPU, as CuPy RawKernels from cuda/*.cu plus cuBLAS GEMMs.

Every op method checks shapes here, and dtypes/contiguity through `kernel_specs.pack_args`, then hands
(kernel, grid, block, shared memory, arguments) to a launcher (backend/cuda_runtime.py).  `CuPyLauncher`
launches on the GPU; the test harness tests/cuda_shim supplies a host launcher instead, so these very
methods (geometry, checks, packing) run in CI on NumPy arrays with the kernels compiled by g++.

Device dtypes.  Weights, KV cache and activations share one storage dtype: the model's (float32,
float16 or bfloat16), except the residual stream, which may be float32 (the pool keeps it so:
embedding, rmsnorm and add_rmsnorm take a second element type R for it); every kernel computes in
float32.  CuPy has no bfloat16, so a bfloat16 tensor
lives on the device as uint16 bit patterns: `carve`, `upload` and `to_host` translate, and no other
uint16 device array exists in this backend.  `linear` may write float32 output from 16-bit inputs
(for logits).  int8 weight-only models are not supported here (the engine refuses them at start).

GEMM convention, stated once.  rawinfer stores matrices row-major: x[T, K], w[N, K] (out features x in
features), out[T, N], and computes out = x @ w^T.  cuBLAS reads column-major, and a row-major [r, c]
buffer IS the column-major [c, r] matrix.  So cuBLAS sees w as w^T [K, N] (lda = K), x as x^T [K, T]
(ldb = K), out as out^T [N, T] (ldc = N), and out^T = w @ x^T is

    gemmEx(transa=T, transb=N, m=N, n=T, k=K, A=w, lda=K, B=x, ldb=K, C=out, ldc=N)

in float32 accumulation (CUBLAS_COMPUTE_32F; tensor cores for fp16/bf16 inputs).

CUDA graphs.  `capture_graph(fn)` runs fn once eagerly, then has the launcher record its launches
(cuda_runtime.py states the rules fn must follow); `graph.replay()` re-issues them.  The decode
split-K scratch must be bound first (`bind_attention_workspace`, a carve of the pool sized by
`attention_workspace_bytes`), and fn must pass a fixed max_context_len (the model runner passes the
longest context the engine allows) so the decode grid does not change between steps.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.base import Backend, Capabilities
from rawinfer.backend.cuda.runtime import (CUDAGraph, CuPyLauncher, cuda_available, cuda_status,  # noqa: F401
                                           kernel_source)
from rawinfer.quant import Int8Weight

try:
    from ml_dtypes import bfloat16 as _BF16
except ImportError:  # pragma: no cover
    _BF16 = None

MAX_SHARED_BYTES = 48 * 1024   # dynamic shared memory any launch may use without an opt-in
DECODE_THREADS = 128           # must match cuda/paged_attention_decode.cu
DECODE_HEADS_PER_PASS = 4      # GC in cuda/paged_attention_decode.cu
PREFILL_ROWS = 16              # must match cuda/paged_attention_prefill.cu
PREFILL_THREADS = 128
MAX_HEAD_DIM = 256


# ---- the backend ------------------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _row_threads(n: int) -> int:
    """Threads for a block that walks one row of n elements: about 4 elements each, 32..1024."""
    return min(1024, max(32, _round_up(-(-n // 4), 32)))


def _shape_error(op: str, name: str, got, want: str) -> ValueError:
    return ValueError(f"{op}: {name} has shape {tuple(got)} but must be {want}")


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, launcher: Any = None, *, device_id: int = 0, decode_partition: int = 512):
        """launcher None: the GPU (CuPy).  Otherwise an object with launch()/gemm() like CuPyLauncher,
        and arrays are NumPy arrays (the host shim of the tests).  decode_partition: context positions
        per split of the decode kernel (rounded to whole KV blocks)."""
        if launcher is None:
            usable, why = cuda_status()
            if not usable:
                raise RuntimeError(f"the CUDA backend cannot start: {why}; use --device cpu instead")
            import cupy
            cupy.cuda.Device(device_id).use()
            self.xp = cupy
            self._launcher = CuPyLauncher()
        else:
            self.xp = np
            self._launcher = launcher
        self.decode_partition = decode_partition
        self._workspace = None          # float32 [n]: split-K partial results of decode attention
        self._workspace_bound = False
        self.capabilities = Capabilities(on_gpu=self.on_gpu, graphs=self.supports_graphs, device_sampling=True)

    @property
    def on_gpu(self) -> bool:
        return self.xp is not np

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

    # ---- launching ------------------------------------------------------------------------------
    def _launch(self, kernel: str, targs: tuple[str, ...], grid, block, shared_mem: int, *args) -> None:
        spec = ks.SPECS[kernel]
        packed = ks.pack_args(spec, targs, args)
        if shared_mem > MAX_SHARED_BYTES:
            raise ValueError(f"{kernel} would need {shared_mem} bytes of shared memory (limit {MAX_SHARED_BYTES}); "
                             "use a smaller block size or head dimension")
        self._launcher.launch(spec, targs, grid, block, shared_mem, packed)

    def _address(self, a) -> int:
        return int(a.data.ptr) if self.on_gpu else int(a.ctypes.data)

    # ---- layer ops ------------------------------------------------------------------------------
    def embedding(self, ids, table, out) -> None:
        (n,), (vocab, hidden) = ids.shape, table.shape
        if tuple(out.shape) != (n, hidden):
            raise _shape_error("embedding", "out", out.shape, f"(T, C) = ({n}, {hidden})")
        if n:
            self._launch("embedding_kernel", (ks.element_type(table.dtype), ks.element_type(out.dtype)), (n,),
                         (_row_threads(hidden),), 0, out, ids, table, hidden)

    def rmsnorm(self, x, weight, eps: float, out) -> None:
        n, hidden = x.shape
        self._check_norm("rmsnorm", x, weight, out)
        if n:
            self._launch("rmsnorm_kernel", (ks.element_type(weight.dtype), ks.element_type(x.dtype)), (n,),
                         (_row_threads(hidden),), 0, out, x, weight, hidden, eps)

    def add_rmsnorm(self, x, residual, weight, eps: float, out) -> None:
        n, hidden = x.shape
        self._check_norm("add_rmsnorm", x, weight, out)
        if tuple(residual.shape) != tuple(x.shape):
            raise _shape_error("add_rmsnorm", "residual", residual.shape, f"like x, {tuple(x.shape)}")
        if n:
            self._launch("add_rmsnorm_kernel", (ks.element_type(weight.dtype), ks.element_type(residual.dtype)),
                         (n,), (_row_threads(hidden),), 0, out, residual, x, weight, hidden, eps)

    @staticmethod
    def _check_norm(op, x, weight, out) -> None:
        if len(x.shape) != 2:
            raise _shape_error(op, "x", x.shape, "(T, C)")
        if tuple(weight.shape) != (x.shape[1],):
            raise _shape_error(op, "weight", weight.shape, f"(C,) = ({x.shape[1]},)")
        if tuple(out.shape) != tuple(x.shape):
            raise _shape_error(op, "out", out.shape, f"like x, {tuple(x.shape)}")

    def linear(self, x, w, out, bias=None, scratch=None) -> None:
        """out[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]) through cuBLAS.  `scratch` is unused: it exists
        for the CPU's int8 path, and int8 weights are refused here."""
        if isinstance(w, Int8Weight):
            raise ValueError("int8 weight-only models run on the CPU backend; convert without --quant "
                             "for --device cuda")
        (n, k), (n_out, k_w) = x.shape, w.shape
        if k_w != k:
            raise _shape_error("linear", "w", w.shape, f"(N, K) with K = {k} (x is {tuple(x.shape)})")
        if tuple(out.shape) != (n, n_out):
            raise _shape_error("linear", "out", out.shape, f"(T, N) = ({n}, {n_out})")
        if x.dtype != w.dtype or out.dtype not in (x.dtype, np.dtype(np.float32)):
            raise ValueError(f"linear: x ({x.dtype}) and w ({w.dtype}) must share a dtype and out ({out.dtype}) "
                             "must have it too or be float32")
        for name, a in (("x", x), ("w", w), ("out", out)):
            if not a.flags.c_contiguous:
                raise ValueError(f"linear: {name} must be C-contiguous")
        if n == 0:
            return
        beta = 0.0
        if bias is not None:
            if tuple(bias.shape) != (n_out,) or bias.dtype != out.dtype:
                raise ValueError(f"linear: bias must have shape ({n_out},) and out's dtype {out.dtype}, "
                                 f"got {tuple(bias.shape)} {bias.dtype}")
            out[...] = bias[None, :]   # a plain copy of bits: exact for uint16-stored bf16 too
            beta = 1.0
        self._launcher.gemm(True, False, n_out, n, k, w, k, x, k, out, n_out, beta)

    def rope(self, qkv, positions, cos_sin, num_heads: int, num_kv_heads: int) -> None:
        n, width = qkv.shape
        heads = num_heads + 2 * num_kv_heads
        head_dim = width // heads
        if head_dim * heads != width or head_dim % 2:
            raise _shape_error("rope", "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) with H + 2 Hkv = {heads}, D even")
        if tuple(positions.shape) != (n,):
            raise _shape_error("rope", "positions", positions.shape, f"(T,) = ({n},)")
        if len(cos_sin.shape) != 2 or cos_sin.shape[1] != head_dim:
            raise _shape_error("rope", "cos_sin", cos_sin.shape, f"(P, D) with D = {head_dim}")
        if n:
            pairs = (num_heads + num_kv_heads) * head_dim // 2
            self._launch("rope_kernel", (ks.element_type(qkv.dtype),), (n,), (_row_threads(pairs),), 0,
                         qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up, out) -> None:
        n, width = gate_up.shape
        ffn = width // 2
        if width % 2 or tuple(out.shape) != (n, ffn):
            raise _shape_error("silu_mul", "out", out.shape, f"(T, F) = ({n}, {ffn}) for gate_up {tuple(gate_up.shape)}")
        if n:
            threads = min(256, _round_up(ffn, 32))
            self._launch("silu_mul_kernel", (ks.element_type(out.dtype),), (n, -(-ffn // threads)), (threads,), 0,
                         out, gate_up, ffn)

    def kv_write(self, qkv, k_cache, v_cache, slot_mapping, num_heads: int) -> None:
        _, num_kv_heads, block_size, head_dim = self._check_caches("kv_write", k_cache, v_cache)
        n = qkv.shape[0]
        if tuple(qkv.shape) != (n, (num_heads + 2 * num_kv_heads) * head_dim):
            raise _shape_error("kv_write", "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) = (T, {(num_heads + 2 * num_kv_heads) * head_dim})")
        if tuple(slot_mapping.shape) != (n,):
            raise _shape_error("kv_write", "slot_mapping", slot_mapping.shape, f"(T,) = ({n},)")
        if n:
            self._launch("kv_write_kernel", (ks.element_type(qkv.dtype),), (n,), (_row_threads(num_kv_heads * head_dim),),
                         0, k_cache, v_cache, qkv, slot_mapping, num_heads, num_kv_heads, head_dim, block_size)

    @staticmethod
    def _check_caches(op, k_cache, v_cache) -> tuple[int, int, int, int]:
        if len(k_cache.shape) != 4:
            raise _shape_error(op, "k_cache", k_cache.shape, "(NB, Hkv, BS, D)")
        if tuple(v_cache.shape) != tuple(k_cache.shape) or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"{op}: v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                             f"{tuple(k_cache.shape)} {k_cache.dtype}")
        return tuple(int(s) for s in k_cache.shape)

    # ---- attention ------------------------------------------------------------------------------
    def paged_attention(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                        scale: float, out, max_query_len: int, max_context_len: int) -> None:
        """Decode batches (every sequence has one query) take the split-K decode kernel; anything
        else (prefill, chunked prefill, mixed batches) takes the tiled prefill kernel."""
        if max_query_len == 1:
            self.paged_attention_decode(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                        scale, out, max_context_len)
        else:
            self.paged_attention_prefill(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                         scale, out, max_query_len)

    def _attention_shapes(self, op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out):
        _, num_kv_heads, block_size, head_dim = self._check_caches(op, k_cache, v_cache)
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim {head_dim} is larger than the kernels support ({MAX_HEAD_DIM})")
        n = qkv.shape[0]
        num_heads = out.shape[1] // head_dim if len(out.shape) == 2 else 0
        if len(out.shape) != 2 or out.shape[0] != n or num_heads * head_dim != out.shape[1] \
                or num_heads % num_kv_heads:
            raise _shape_error(op, "out", out.shape, f"(T, H * D) with T = {n}, D = {head_dim}, H a multiple of Hkv = {num_kv_heads}")
        if tuple(qkv.shape) != (n, (num_heads + 2 * num_kv_heads) * head_dim):
            raise _shape_error(op, "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) = ({n}, {(num_heads + 2 * num_kv_heads) * head_dim})")
        batch = context_lens.shape[0]
        if tuple(query_start_loc.shape) != (batch + 1,):
            raise _shape_error(op, "query_start_loc", query_start_loc.shape, f"(B + 1,) = ({batch + 1},)")
        if len(block_tables.shape) != 2 or block_tables.shape[0] != batch:
            raise _shape_error(op, "block_tables", block_tables.shape, f"(B, MB) with B = {batch}")
        if qkv.dtype != k_cache.dtype or out.dtype != qkv.dtype:
            raise ValueError(f"{op}: qkv ({qkv.dtype}), the caches ({k_cache.dtype}) and out ({out.dtype}) "
                             "must share one dtype")
        return batch, num_heads, num_kv_heads, block_size, head_dim

    def decode_partition_size(self, group: int, head_dim: int, block_size: int, itemsize: int) -> int:
        """Positions per split of the decode kernel: whole KV blocks, near decode_partition, and small
        enough that the block's shared memory fits."""
        partition = max(block_size, self.decode_partition // block_size * block_size)
        while partition > block_size and self._decode_smem(group, head_dim, partition, itemsize) > MAX_SHARED_BYTES:
            partition -= block_size
        return partition

    @staticmethod
    def _decode_smem(group: int, head_dim: int, partition: int, itemsize: int) -> int:
        token_groups = DECODE_THREADS // (head_dim * itemsize // 16)
        return 4 * (group * head_dim + group * partition + token_groups * DECODE_HEADS_PER_PASS * head_dim)

    def attention_workspace_bytes(self, max_num_seqs: int, num_heads: int, head_dim: int, block_size: int,
                                  max_context_len: int, itemsize: int, num_kv_heads: int) -> int:
        """Bytes of split-K scratch a decode step of up to max_num_seqs sequences needs."""
        partition = self.decode_partition_size(num_heads // num_kv_heads, head_dim, block_size, itemsize)
        splits = -(-max_context_len // partition)
        return 4 * max_num_seqs * num_heads * splits * (head_dim + 2)

    def bind_attention_workspace(self, buffer) -> None:
        """Use `buffer` (a flat uint8 carve of the pool, 4-byte aligned) as the decode split-K scratch, so
        decoding allocates nothing (required for CUDA graph capture).  None returns to a private,
        growing scratch buffer."""
        self._workspace = None if buffer is None else buffer.view(np.float32)
        self._workspace_bound = buffer is not None

    def _scratch(self, nfloats: int):
        if self._workspace is None or self._workspace.size < nfloats:
            if self._workspace_bound:
                raise RuntimeError(f"the bound attention workspace holds {self._workspace.size} floats but this "
                                   f"decode step needs {nfloats}; size it with attention_workspace_bytes()")
            self._workspace = self.xp.empty(nfloats, np.float32)
        return self._workspace

    def paged_attention_decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               scale: float, out, max_context_len: int) -> None:
        batch, num_heads, num_kv_heads, block_size, head_dim = self._attention_shapes(
            "paged_attention_decode", qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
        itemsize = np.dtype(k_cache.dtype).itemsize
        if head_dim * itemsize % 16:
            raise ValueError(f"paged_attention_decode: head_dim {head_dim} x {itemsize} bytes is not a multiple of "
                             "16 bytes, which the kernel's vector loads need")
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if self._address(a) % 16:
                raise ValueError(f"paged_attention_decode: {name} is not 16-byte aligned; carve it at an aligned offset")
        if batch == 0 or max_context_len < 1:
            return
        group = num_heads // num_kv_heads
        partition = self.decode_partition_size(group, head_dim, block_size, itemsize)
        splits = -(-max_context_len // partition)
        stats = batch * num_heads * splits
        scratch = self._scratch(stats * (head_dim + 2))
        part_out = scratch[:stats * head_dim]
        part_max = scratch[stats * head_dim:stats * (head_dim + 1)]
        part_sum = scratch[stats * (head_dim + 1):stats * (head_dim + 2)]
        targs = (ks.element_type(qkv.dtype),)
        self._launch("paged_attention_decode_kernel", targs, (splits, num_kv_heads, batch), (DECODE_THREADS,),
                     self._decode_smem(group, head_dim, partition, itemsize),
                     part_out, part_max, part_sum, qkv, k_cache, v_cache, block_tables, context_lens,
                     query_start_loc, scale, num_heads, num_kv_heads, head_dim, block_size,
                     block_tables.shape[1], partition, splits)
        self._launch("paged_attention_merge_kernel", targs, (num_heads, batch), (min(1024, _round_up(head_dim, 32)),),
                     0, out, part_out, part_max, part_sum, context_lens, query_start_loc, num_heads, head_dim,
                     partition, splits)

    @staticmethod
    def prefill_kv_tile(head_dim: int, itemsize: int) -> tuple[int, int]:
        """(key positions per tile, shared memory bytes) of the prefill kernel: the largest tile that fits."""
        for tile in (32, 16, 8):
            kv_stride = head_dim + 4 // itemsize
            smem = 4 * (PREFILL_ROWS * (head_dim + 1) + PREFILL_ROWS * 32) + 2 * tile * kv_stride * itemsize
            if smem <= MAX_SHARED_BYTES:
                return tile, smem
        raise ValueError(f"paged_attention_prefill: head_dim {head_dim} does not fit in shared memory")

    def paged_attention_prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale: float, out, max_query_len: int) -> None:
        batch, num_heads, num_kv_heads, block_size, head_dim = self._attention_shapes(
            "paged_attention_prefill", qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
        if batch == 0 or max_query_len < 1:
            return
        tile, smem = self.prefill_kv_tile(head_dim, np.dtype(k_cache.dtype).itemsize)
        self._launch("paged_attention_prefill_kernel", (ks.element_type(qkv.dtype),),
                     (-(-max_query_len // PREFILL_ROWS), num_heads, batch), (PREFILL_THREADS,), smem,
                     out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, num_heads,
                     num_kv_heads, head_dim, block_size, block_tables.shape[1], tile)

    # ---- cache maintenance and gathers ----------------------------------------------------------
    def copy_blocks(self, k_caches, v_caches, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if len(k_caches) != len(v_caches) or not k_caches:
            raise ValueError("copy_blocks: k_caches and v_caches must be equally long, non-empty lists of layers")
        shape = self._check_caches("copy_blocks", k_caches[0], v_caches[0])
        for k, v in zip(k_caches, v_caches):
            if self._check_caches("copy_blocks", k, v) != shape or k.dtype != k_caches[0].dtype:
                raise ValueError("copy_blocks: every layer's cache must have the same shape and dtype")
        num_blocks = shape[0]
        table = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if table.min() < 0 or table.max() >= num_blocks:
            raise ValueError(f"copy_blocks: block ids must be in [0, {num_blocks}), got {pairs}")
        if len(set(table[:, 1].tolist())) != len(table) or set(table[:, 1].tolist()) & set(table[:, 0].tolist()):
            raise ValueError("copy_blocks: every destination block must appear once and never as a source")
        block_bytes = shape[1] * shape[2] * shape[3] * np.dtype(k_caches[0].dtype).itemsize
        k_ptrs = self.xp.asarray(np.array([self._address(k) for k in k_caches], np.uint64))
        v_ptrs = self.xp.asarray(np.array([self._address(v) for v in v_caches], np.uint64))
        dev_pairs = self.xp.asarray(table.astype(np.int32))
        self._launch("copy_blocks_kernel", (), (len(table), len(k_caches)), (256,), 0,
                     k_ptrs, v_ptrs, dev_pairs, block_bytes // 4)

    def take_rows(self, x, indices, out) -> None:
        (n,), (_, cols) = indices.shape, x.shape
        if tuple(out.shape) != (n, cols):
            raise _shape_error("take_rows", "out", out.shape, f"(B, C) = ({n}, {cols})")
        if n:
            self._launch("take_rows_kernel", (ks.element_type(x.dtype),), (n,), (_row_threads(cols),), 0,
                         out, x, indices, cols)

    # ---- sampling -------------------------------------------------------------------------------
    @staticmethod
    def _sample_threads(vocab: int) -> int:
        return min(1024, max(32, _round_up(vocab // 16, 32)))

    def argmax(self, logits) -> np.ndarray:
        """Host int64[B]: the first index of the largest logit of each row, computed on the device."""
        batch, vocab = logits.shape
        ids = self.xp.empty(batch, np.int32)
        if batch:
            self._launch("argmax_kernel", (ks.element_type(logits.dtype),), (batch,),
                         (self._sample_threads(vocab),), 0, ids, logits, vocab)
        return self.to_host(ids).astype(np.int64)

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform) -> np.ndarray:
        """Host int64[B]: one token per row after temperature / top-k / min-p / top-p filtering
        (cuda/sampling.cu states the exact rule).  The per-row parameters are host arrays of length B;
        temperature 0 is greedy; uniform holds one draw in [0, 1) per row from the request's generator.
        Repetition penalties and other logit edits happen before this call (on the host for the rows
        that need them)."""
        batch, vocab = logits.shape
        params = [np.ascontiguousarray(temperature, np.float32), np.ascontiguousarray(top_k, np.int32),
                  np.ascontiguousarray(top_p, np.float32), np.ascontiguousarray(min_p, np.float32),
                  np.ascontiguousarray(uniform, np.float32)]
        for name, p in zip(("temperature", "top_k", "top_p", "min_p", "uniform"), params):
            if p.shape != (batch,):
                raise _shape_error("sample", name, p.shape, f"(B,) = ({batch},)")
        ids = self.xp.empty(batch, np.int32)
        if batch:
            self._launch("sample_kernel", (ks.element_type(logits.dtype),), (batch,), (self._sample_threads(vocab),),
                         0, ids, logits, *[self.xp.asarray(p) for p in params], vocab)
        return self.to_host(ids).astype(np.int64)

    # ---- CUDA graphs ----------------------------------------------------------------------------
    @property
    def supports_graphs(self) -> bool:
        """True when the launcher can capture graphs (the GPU's can; a test launcher may)."""
        return callable(getattr(self._launcher, "capture", None))

    def capture_graph(self, fn: Callable[[], None]) -> CUDAGraph:
        """Run fn eagerly once (compiles everything, warms cuBLAS; its results are real results), then
        capture it as a graph whose replay() repeats it on whatever its input buffers then hold."""
        if not self.supports_graphs:
            raise RuntimeError("this backend's launcher cannot capture CUDA graphs; run without CUDA graphs")
        fn()
        self.synchronize()
        return self._launcher.capture(fn)
