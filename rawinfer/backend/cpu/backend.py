"""CPUBackend: the op interface on NumPy (BLAS GEMMs) and Numba kernels, float32 storage and compute."""

from __future__ import annotations

import numba
import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.base import Backend, Capabilities
from rawinfer.backend.cpu import attention as A
from rawinfer.backend.cpu import blas as cpu_blas
from rawinfer.backend.cpu import cache as cpu_cache
from rawinfer.backend.cpu import kernels as K
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu import memory as cpu_memory
from rawinfer.backend.cpu import q4 as cpu_q4
from rawinfer.backend.cpu import qgemm as cpu_qgemm
from rawinfer.backend.cpu.fused import NO_BIAS, decoder_stack_batched_kernel, decoder_stack_kernel
from rawinfer.backend.cpu.threads import ThreadGovernor, configure_spin
from rawinfer.quant import Q4_BLOCK, Q4_SPAN as SPAN
from rawinfer.quant import Int8Weight, Q4Weight

ATTN_QUERY_TILE = 16   # queries per attention work item: K/V rows are streamed once per tile
ATTN_BLAS_MIN_QUERY = 32   # batches with a query run this long take the BLAS attention (prefill)...
ATTN_BLAS_QUERY_TILE = 64  # ... in tiles of this many queries
INT8_GEMV_MAX_ROWS = 4  # int8 / q4 matmul: up to this many rows, dot products straight from the quantized
                        # weights; above, the integer GEMM (int8) or BLAS on dequantized row tiles
INT8_TILE_ROWS = 128    # weight rows per dequantized tile (128 x 576 floats: 288 KiB, fits in L2)


def _check(name: str, x, dtype=None, contiguous: bool = True) -> None:
    """What the kernels need of an argument beyond its shape (backend/shapes.py checks those): a NumPy
    array, of dtype where given, C-contiguous (kernels index raw rows). Cheap: it runs for every
    argument of every op of every step."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {x.dtype}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _kv(cache):
    """A KV cache as the kernels take it: float16 caches as their uint16 bits (Numba has no float16)."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


class CPUBackend(Backend):
    name = "cpu"
    xp = np
    capabilities = Capabilities(quantized_weights=("int8", "q4"))

    def fused_max_tokens(self, quant):
        # int8 / q4 decode: every layer in one Numba call (fused.py), which saves the per-op dispatch.
        # Float weights keep the per-op path: BLAS's GEMV streams float32 rows faster than a Numba row
        # kernel would. q4's matrix-vector kernel is AVX2 code (q4.py): elsewhere its products take the
        # per-op BLAS path. Measurements: docs/kernels.md.
        if quant == "q4" and not cpu_llvm.available():
            return 0
        return INT8_GEMV_MAX_ROWS if quant in ("int8", "q4") else 0

    def __init__(self, num_threads: int | None = None, int_gemm: bool = True, cache_dir: str | None = None):
        """num_threads: the Numba pool's size (None: every core). int_gemm: int8 models' GEMMs (more than
        INT8_GEMV_MAX_ROWS rows) in integer arithmetic on int16-quantized activations (qgemm.py) where
        the CPU has AVX2; False dequantizes the weights to float32 for BLAS instead
        (EngineConfig.cpu_int_gemm, RAWINFER_CPU_INT_GEMM=0). cache_dir: the user cache whose kernels/
        folder keeps the compiled kernels (EngineConfig.cache_dir; None: Numba's own locations)."""
        # before any kernel of this process compiles or loads
        self.kernel_cache = cpu_cache.install(cache_dir) if cache_dir is not None else None
        self.blas_on_numba_pool = cpu_blas.available()   # else np.matmul on OpenBLAS's (or MKL's) own pool
        configure_spin(self.blas_on_numba_pool)
        if num_threads is not None:
            numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
        self.threads = numba.get_num_threads()          # used by the next parallel regions
        # NOTE: work is split into max_threads parts whatever the current thread count: a BLAS call's bits
        # depend on the shape of the slice it gets, and outputs must not depend on the governor's choice.
        self.max_threads = self.threads
        # num_threads None: every core while the machine is otherwise idle, fewer while other processes
        # keep cores busy (threads.py); a number given is kept as it is.
        self._governor = ThreadGovernor(self.threads) if num_threads is None and self.threads > 1 else None
        self.int_gemm = int_gemm and cpu_qgemm.available()
        self._qx = np.empty(0, np.int16)                   # activation buffers of the integer GEMM,
        self._qs = np.empty(0, np.float32)                 # grown to the largest batch seen

    def begin_step(self) -> None:
        if self._governor is not None and (n := self._governor.update()) != self.threads:
            numba.set_num_threads(n)
            self.threads = n

    def kv_dtype(self, model_dtype: str, choice: str = "auto", quant: str | None = None) -> np.dtype:
        # Decode attention streams every cached K/V row each step: float16 halves those bytes, int8 (a
        # float32 scale per row of head_dim values) brings them to (head_dim + 4) / (4 head_dim). auto:
        # int8 for int8 models, built for many sequences, whose golden agreement holds with it
        # (tests/backend/test_quant.py); float16 for q4 models, built for one stream, whose agreement
        # is best with it (test_q4.py: the int8 cache's rounding flips near-ties that float16 keeps);
        # float32 for float models, exact. float16 needs F16C (every x86-64 CPU with AVX2 has it).
        f16c = cpu_llvm.has_f16c()
        if choice == "float16" and not f16c:
            raise ValueError("kv_cache_dtype='float16' needs a CPU with F16C conversions, which this one lacks; "
                             "use kv_cache_dtype='int8' or 'float32' (--kv-cache-dtype)")
        if choice == "auto":
            choice = "float32" if quant is None else "float16" if quant == "q4" and f16c else "int8"
        return np.dtype(choice)

    # ---- memory (memory.py) ------------------------------------------------------------------
    def alloc_arena(self, nbytes: int):
        return cpu_memory.anonymous_arena(nbytes)

    def prefault(self, arena, offset, nbytes) -> None:
        cpu_memory.populate(arena, offset, nbytes, self.threads)

    def prepare_int8(self, w):
        if self.int_gemm and cpu_qgemm.supports(w.shape):
            import dataclasses
            return dataclasses.replace(w, packed=cpu_qgemm.pack_weights(w.q))
        return w

    def upload(self, dst, src) -> None:
        src = np.asarray(src)
        if src.shape != dst.shape:
            raise ValueError(f"upload: source shape {src.shape} does not match destination {dst.shape}")
        np.copyto(dst, src, casting="unsafe")

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    # ---- layer ops ---------------------------------------------------------------------------
    def embedding(self, ids, table, out) -> None:
        shapes.embedding(ids, table.shape, out)
        _check("ids", ids, np.int32)
        _check("out", out)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise ValueError(f"token id out of range [0, {table.shape[0]})")
        if isinstance(table, Int8Weight):
            K.int8_embedding_kernel(ids, table.q, table.scale, out)
        else:
            K.take_rows_kernel(table, ids, out)

    def rmsnorm(self, x, weight, eps, out) -> None:
        shapes.norm("rmsnorm", x, weight, out)
        _check("x", x)
        _check("out", out)
        K.rmsnorm_kernel(x.shape[0], x, weight, np.float32(eps), out)

    def add_rmsnorm(self, x, residual, weight, eps, out) -> None:
        shapes.norm("add_rmsnorm", x, weight, out, residual)
        _check("x", x)
        _check("residual", residual, np.float32)
        _check("out", out)
        K.add_rmsnorm_kernel(x.shape[0], x, residual, weight, np.float32(eps), out)

    def linear(self, x, w, out, bias=None, scratch=None) -> None:
        shapes.linear(x, w.shape, out, bias)
        _check("x", x, np.float32)              # BLAS and the int8 quantizer read it as raw float32
        _check("out", out)
        if isinstance(w, Int8Weight):
            self._linear_int8(x, w, out, scratch)
        elif isinstance(w, Q4Weight):
            self._linear_q4(x, w, out, scratch)
        elif self.blas_on_numba_pool:
            cpu_blas.matmul_nt(x, w, out, max(1, min(self.max_threads, w.shape[0] // 64)))
        else:
            # NOTE: w.T is a transposed view; NumPy hands it to BLAS as a transpose flag, no copy.
            np.matmul(x, w.T, out=out)
        if bias is not None:
            out += bias

    def linear_silu_mul(self, x, w, gate_up, out, scratch=None) -> None:
        # int8 GEMMs on packed weights: silu * up in the GEMM's epilogue, gate_up never stored (the same
        # bits as the GEMM and silu_mul apart). Gate block j pairs with up block j + half: an even count
        # of 16-column blocks (the batched decode kernel's test too). A few rows: silu * up in the int8
        # matrix-vector kernel the same way.
        if isinstance(w, Int8Weight):
            gemm = self._on_packed_gemm(x, w, scratch) and w.packed.shape[0] % 2 == 0
            if gemm or x.shape[0] <= INT8_GEMV_MAX_ROWS or scratch is None:
                shapes.linear_silu_mul(x, w.shape, out)
                _check("x", x, np.float32)
                _check("out", out)
                if gemm:
                    cpu_qgemm.int8_matmul_silu(x, w.packed, w.scale, out, *self._int_gemm_buffers(*x.shape))
                else:
                    K.rows_matmul_silu_kernel(x, w.q, w.scale, out)
                return
        if isinstance(w, Q4Weight) and self._q4_matvec(x, scratch):
            shapes.linear_silu_mul(x, w.shape, out)
            _check("x", x, np.float32)
            _check("out", out)
            cpu_q4.q4_matvec_silu(x, *self._q4_parts(w), out)
            return
        super().linear_silu_mul(x, w, gate_up, out, scratch)

    @staticmethod
    def _on_packed_gemm(x, w: Int8Weight, scratch) -> bool:
        """Whether an int8 product of x takes the integer GEMM on w's packed copy (more rows than the
        matrix-vector kernel takes, a workspace given, a packed copy made at load)."""
        return x.shape[0] > INT8_GEMV_MAX_ROWS and scratch is not None and w.packed is not None

    def _linear_int8(self, x, w: Int8Weight, out, scratch) -> None:
        T, Kd = x.shape[0], w.shape[1]
        if self._on_packed_gemm(x, w, scratch):
            cpu_qgemm.int8_matmul(x, w.packed, w.scale, out, *self._int_gemm_buffers(T, Kd))
            return
        if T <= INT8_GEMV_MAX_ROWS or scratch is None:
            K.rows_matmul_kernel(x, w.q, w.scale, out)
            return
        self._dequantized_matmul(x, w.q, w.scale, out, scratch)

    @staticmethod
    def _q4_matvec(x, scratch) -> bool:
        """Whether a q4 product of x takes the matrix-vector kernel (a few rows, or no workspace for the
        BLAS path) rather than BLAS on dequantized tiles; the kernel needs AVX2."""
        return cpu_llvm.available() and (x.shape[0] <= INT8_GEMV_MAX_ROWS or scratch is None)

    @staticmethod
    def _q4_parts(w: Q4Weight) -> tuple[np.ndarray, np.ndarray]:
        """(nibbles, block scales as uint16 float16 bits): what the q4 kernels take, after checking that
        the pair is one quant.quantize_q4 makes (the kernels read it through raw addresses)."""
        N, Kd = w.shape
        if Kd % SPAN or w.dm.shape != (N, Kd // Q4_BLOCK, 2) or w.dm.dtype != np.float16:
            raise ValueError(f"a q4 weight of shape {w.shape} needs K % {SPAN} == 0 and float16 block scales "
                             f"[N, K/{Q4_BLOCK}, 2], got {w.dm.dtype} {w.dm.shape}; build it with quant.quantize_q4")
        return w.qs, w.dm.view(np.uint16)

    def _linear_q4(self, x, w: Q4Weight, out, scratch) -> None:
        qs, dm = self._q4_parts(w)
        if self._q4_matvec(x, scratch):
            cpu_q4.q4_matvec(x, qs, dm, out)
            return
        if scratch is None:                              # no AVX2 and no workspace: a tile of our own
            scratch = np.empty(min(w.shape[0], INT8_TILE_ROWS) * self.max_threads * w.shape[1], np.float32)
        self._dequantized_matmul(x, qs.view(np.uint16), dm, out, scratch)

    def _dequantized_matmul(self, x, a, b, out, scratch) -> None:
        """out = x @ W^T, W given as (a, b) (q4.dequantize_tile), on BLAS over float32 tiles of W
        dequantized into scratch."""
        N, Kd = out.shape[1], x.shape[1]
        tile = min(INT8_TILE_ROWS, scratch.size // (self.max_threads * Kd))
        if self.blas_on_numba_pool and tile >= 1:
            cpu_blas.quant_matmul_nt(x, a, b, out, scratch, tile, self.max_threads)
            return
        tile = max(1, min(N, scratch.size // Kd))        # rows of W dequantized per BLAS call
        for n0 in range(0, N, tile):
            n1 = min(N, n0 + tile)
            wt = scratch[:(n1 - n0) * Kd].reshape(n1 - n0, Kd)
            if a.dtype == np.int8:
                K.int8_dequant_rows_kernel(a, b, n0, wt)
            else:
                cpu_q4.dequantize_rows(a, b, n0, wt)
            if n0 == 0 and n1 == N:
                np.matmul(x, wt.T, out=out)
            else:
                out[:, n0:n1] = x @ wt.T

    def _int_gemm_buffers(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The integer GEMM's activation buffers (int16 panels, float32 scales) for up to rows x k,
        grown to the largest batch seen."""
        nx, ns = cpu_qgemm.x_buffer_sizes(rows, k)
        if self._qx.size < nx:
            self._qx = np.empty(nx, np.int16)
        if self._qs.size < ns:
            self._qs = np.empty(ns, np.float32)
        return self._qx, self._qs

    def rope(self, qkv, positions, cos_sin, num_heads, num_kv_heads) -> None:
        _, D = shapes.rope(qkv, positions, cos_sin, num_heads, num_kv_heads)
        _check("qkv", qkv)
        _check("positions", positions, np.int32)
        if positions.size and (positions.min() < 0 or positions.max() >= cos_sin.shape[0]):
            raise ValueError(f"position out of range [0, {cos_sin.shape[0]}): the model's context is exceeded")
        K.rope_kernel(qkv.shape[0], qkv, positions, cos_sin, num_heads, num_kv_heads, D)

    def silu_mul(self, gate_up, out) -> None:
        shapes.silu_mul(gate_up, out)
        _check("gate_up", gate_up)
        _check("out", out)
        K.silu_mul_kernel(gate_up.shape[0], gate_up, out)

    def kv_write(self, qkv, k_cache, v_cache, slot_mapping, num_heads) -> None:
        shapes.kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)
        _check("qkv", qkv)
        _check("slot_mapping", slot_mapping, np.int32)
        K.kv_write_kernel(qkv.shape[0], qkv, _kv(k_cache), _kv(v_cache), slot_mapping, num_heads)

    def paged_attention_decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               scale, out, max_context_len) -> None:
        B, H, Hkv = self._attention_args("paged_attention_decode", qkv, k_cache, v_cache, block_tables,
                                         context_lens, query_start_loc, out)
        k_cache, v_cache = _kv(k_cache), _kv(v_cache)
        kernel = A.decode_attention_avx2_kernel if A.decode_attention_avx2_fits(k_cache) else A.decode_attention_kernel
        kernel(B * Hkv, qkv, k_cache, v_cache, block_tables, context_lens, np.float32(scale), H, out)

    def paged_attention_prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale, out, max_query_len) -> None:
        _, H, Hkv = self._attention_args("paged_attention_prefill", qkv, k_cache, v_cache, block_tables,
                                         context_lens, query_start_loc, out)
        k_cache, v_cache = _kv(k_cache), _kv(v_cache)
        if self.blas_on_numba_pool and max_query_len >= ATTN_BLAS_MIN_QUERY:   # long queries: products on BLAS
            seqs, q0, q1 = A.attention_work_items(query_start_loc, ATTN_BLAS_QUERY_TILE)
            cpu_blas.prefill_attention(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, seqs,
                                       q0, q1, np.float32(scale), H, out, self.max_threads)
            return
        seqs, q0, q1 = A.attention_work_items(query_start_loc, ATTN_QUERY_TILE)   # [W] each
        A.paged_attention_kernel(len(seqs) * Hkv, qkv, k_cache, v_cache, block_tables, context_lens,
                                 query_start_loc, seqs, q0, q1, np.float32(scale), H, out)

    @staticmethod
    def _attention_args(op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out):
        """(B, H, Hkv) of an attention call, after checking its shapes and what the kernels read raw:
        contiguous rows, int32 metadata."""
        _, B, H, Hkv, _ = shapes.attention(op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                           out)
        _check("qkv", qkv)
        _check("out", out)
        _check("block_tables", block_tables, np.int32)
        _check("context_lens", context_lens, np.int32)
        _check("query_start_loc", query_start_loc, np.int32)
        return B, H, Hkv

    def fused_plan(self, layers, k_caches, v_caches):
        """The per-layer tensors as typed lists (built once), so one Numba call can walk every layer."""
        from numba.typed import List

        def typed(arrays):
            out = List()
            for a in arrays:
                out.append(a)
            return out
        mats = (("qkv", "qkv_proj"), ("o", "o_proj"), ("gu", "gate_up_proj"), ("down", "down_proj"))
        cols = {f"{kind}_{short}s": [] for short, _ in mats for kind in ("w", "s", "p")}
        for L in layers:
            for short, name in mats:                        # fused only for quantized models
                w = getattr(L, name)
                q4 = isinstance(w, Q4Weight)                # fused.weight_matvec takes either kind
                a, b = self._q4_parts(w) if q4 else (w.q, w.scale)
                cols[f"w_{short}s"].append(a)
                cols[f"s_{short}s"].append(b)
                cols[f"p_{short}s"].append(None if q4 else w.packed)
        packed = all(p is not None for short, _ in mats for p in cols[f"p_{short}s"])
        plan = {k: typed(v) for k, v in cols.items() if not k.startswith("p_") or packed}
        plan["packed"] = packed                             # batched decode: integer GEMMs on the packed copies
        plan["in_norms"] = typed([L.input_norm for L in layers])
        plan["post_norms"] = typed([L.post_attn_norm for L in layers])
        plan["b_qkvs"] = typed([L.qkv_bias if L.qkv_bias is not None else NO_BIAS for L in layers])
        plan["k_caches"], plan["v_caches"] = typed([_kv(c) for c in k_caches]), typed([_kv(c) for c in v_caches])
        plan["avx2_attention"] = A.decode_attention_avx2_fits(plan["k_caches"][0])
        plan["max_k"] = max(getattr(L, name).shape[1] for L in layers for _, name in mats)
        return plan

    def fused_decode_max_tokens(self, plan) -> int:
        # Batched decode of an int8 model in one call as well: ~11 ops per layer of Python and Numba
        # dispatch saved on every step, whatever the batch (fused.py).
        return 1 << 30 if plan["packed"] else 0

    def decoder_layers(self, plan, acts, T, batch, cos_sin, eps, scale, num_heads, num_kv_heads) -> None:
        for name in ("positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc"):
            _check(name, getattr(batch, name), np.int32)
        p = plan
        if T > INT8_GEMV_MAX_ROWS:
            if not p["packed"] or batch.max_query_len != 1:
                raise ValueError(f"decoder_layers takes at most {INT8_GEMV_MAX_ROWS} tokens, or a pure decode "
                                 f"batch of an int8 model with packed weights; got {T} tokens")
            qx, qs = self._int_gemm_buffers(T, p["max_k"])
            decoder_stack_batched_kernel(
                acts.hidden[:T], acts.residual[:T], acts.normed[:T], acts.qkv[:T], acts.attn[:T], acts.gate_up[:T],
                acts.act[:T],
                p["in_norms"], p["p_qkvs"], p["s_qkvs"], p["b_qkvs"], p["p_os"], p["s_os"], p["post_norms"],
                p["p_gus"], p["s_gus"], p["p_downs"], p["s_downs"], batch.positions, batch.slot_mapping,
                batch.block_tables, batch.context_lens, p["k_caches"], p["v_caches"], cos_sin, np.float32(eps),
                np.float32(scale), num_heads, num_kv_heads, qx, qs, p["avx2_attention"])
            return
        decoder_stack_kernel(
            acts.hidden[:T], acts.residual[:T], acts.normed[:T], acts.qkv[:T], acts.attn[:T], acts.gate_up[:T],
            acts.act[:T],
            p["in_norms"], p["w_qkvs"], p["s_qkvs"], p["b_qkvs"], p["w_os"], p["s_os"], p["post_norms"],
            p["w_gus"], p["s_gus"], p["w_downs"], p["s_downs"], batch.positions, batch.slot_mapping,
            batch.block_tables, batch.context_lens, batch.query_start_loc, p["k_caches"], p["v_caches"],
            cos_sin, np.float32(eps), np.float32(scale), num_heads, num_kv_heads, ATTN_QUERY_TILE)

    def copy_blocks(self, k_caches, v_caches, pairs) -> None:
        if not pairs:
            return
        src = np.asarray([p[0] for p in pairs], np.int64)
        dst = np.asarray([p[1] for p in pairs], np.int64)
        for cache in list(k_caches) + list(v_caches):
            K.copy_blocks_kernel(_kv(cache), src, dst)

    def take_rows(self, x, indices, out) -> None:
        shapes.take_rows(x, indices, out)
        _check("out", out)
        K.take_rows_kernel(x, indices, out)
