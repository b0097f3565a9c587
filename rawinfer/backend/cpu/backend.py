"""CPUBackend: the op interface on NumPy (BLAS GEMMs) and Numba kernels, float32 storage and compute
(quantized weights' products: the QuantizedProducts of products.py it owns).

fp8 models (quant.py) run on the reference path: prepare_weight dequantizes each fp8 matrix, the
embedding table too, to float32 once at load (quant.dequantize_fp8), and every op then computes as for
a float32 model with those weights (float32 K/V by default as well). This costs memory: the pool holds
the fp8 codes (1 byte a weight) and the float32 copies (4 bytes a weight) live beside it, 5 bytes a
weight in all against a float32 model's 4; the format's speed is for GPUs with FP8 tensor cores."""

from __future__ import annotations

import numba
import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.base import Backend, Capabilities
from rawinfer.backend.cpu import a8gemm as cpu_a8gemm
from rawinfer.backend.cpu import attention as A
from rawinfer.backend.cpu import blas as cpu_blas
from rawinfer.backend.cpu import fgemm as cpu_fgemm
from rawinfer.backend.cpu import cache as cpu_cache
from rawinfer.backend.cpu import fused as cpu_fused
from rawinfer.backend.cpu import kernels as K
from rawinfer.backend.cpu import memory as cpu_memory
from rawinfer.backend.cpu import qgemm as cpu_qgemm
from rawinfer.backend.cpu import rows as cpu_rows
from rawinfer.backend.cpu.fused import NO_BIAS, decoder_stack_batched_kernel, decoder_stack_kernel
from rawinfer.backend.cpu.products import INT8_GEMV_MAX_ROWS, QuantizedProducts, check_array, q4_parts
from rawinfer.backend.cpu import tileattn as cpu_tileattn
from rawinfer.backend.cpu import variants as V
from rawinfer.backend.cpu.threads import ThreadGovernor, configure_spin
from rawinfer.quant import Fp8Weight, Int8Weight, Q4Weight, dequantize_fp8

ATTN_QUERY_TILE = 16       # queries per attention work item: K/V rows are streamed once per tile
ATTN_BLAS_MIN_QUERY = 32   # sequences with this many queries in a step take the BLAS attention...
ATTN_BLAS_QUERY_TILE = 64  # ... in tiles of this many queries


def _kv(cache):
    """A KV cache as the kernels take it: float16 caches as their uint16 bits (Numba has no float16)."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


def _items_of(chosen: np.ndarray, query_start_loc: np.ndarray, tile: int):
    """The attention work items (seq[W], q0[W], q1[W]) of the sequences where `chosen` [B] is true."""
    seqs, q0, q1 = A.attention_work_items(query_start_loc, tile)
    keep = chosen[seqs]
    return seqs[keep], q0[keep], q1[keep]


class CPUBackend(Backend):
    name = "cpu"
    xp = np
    capabilities = Capabilities(quantized_weights=("int8", "q4", "fp8"))

    def fused_max_tokens(self, quant):
        # Decode steps with every layer in one Numba call (fused.py), which saves the per-op dispatch: int8 / q4
        # models, and float32 ones where fgemm runs (AVX2 + FMA; fused_limits: which batches; docs/kernels.md);
        # fp8 models are float32 ones once loaded (prepare_weight).
        if quant in (None, "fp8"):
            return 1 if cpu_fgemm.available() else 0
        return INT8_GEMV_MAX_ROWS if quant in ("int8", "q4") else 0

    def __init__(self, num_threads: int | None = None, int_gemm: bool = True, cache_dir: str | None = None,
                 one_attention: bool = False, int8_activations: bool = False):
        """num_threads: the Numba pool's size (None: every core). int_gemm: int8 and q4 models' products in
        integer arithmetic on int16-quantized activations (qgemm.py, q4gemm.py), for any row count, on
        every CPU; False dequantizes the weights to float32 for BLAS instead (matrix-vector kernels for a
        few rows) (EngineConfig.cpu_int_gemm, RAWINFER_CPU_INT_GEMM=0). cache_dir: the user cache whose kernels/
        folder keeps the compiled kernels (EngineConfig.cache_dir; None: Numba's own locations).
        one_attention: every query of every step through the decode attention kernel, whatever its
        sequence's query count, and every float32 product through the row-invariant GEMM (fgemm.py)
        whatever its row count (EngineConfig.batch_invariant). int8_activations: int8 models' products on
        activations quantized to 8 bits per block of 32 (a8gemm.py; EngineConfig.int8_activations)."""
        self.one_attention = one_attention
        if int8_activations and not cpu_a8gemm.available():
            raise ValueError("int8_activations (--int8-activations) needs a CPU with AVX2 and FMA, which this one "
                             "lacks; leave the option off")
        self.int8_activations = int8_activations
        self.tile_attention = cpu_tileattn.available()   # long query runs on tileattn.py, else on blas.py
        # before any kernel of this process compiles or loads
        self.kernel_cache = cpu_cache.install(cache_dir) if cache_dir is not None else None
        self.blas_on_numba_pool = cpu_blas.available()   # else np.matmul on OpenBLAS's (or MKL's) own pool
        configure_spin(self.blas_on_numba_pool)
        # every core unless told otherwise: not the count an earlier engine of this process left behind
        numba.set_num_threads(min(num_threads or numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS))
        self.threads = numba.get_num_threads()          # used by the next parallel regions
        # NOTE: work is split into max_threads parts whatever the current thread count: a BLAS call's bits
        # depend on the shape of the slice it gets, and outputs must not depend on the governor's choice.
        self.max_threads = self.threads
        # num_threads None: every core while the machine is otherwise idle, fewer while other processes
        # keep cores busy (threads.py); a number given is kept as it is.
        self._governor = ThreadGovernor(self.threads) if num_threads is None and self.threads > 1 else None
        self.int_gemm = int_gemm
        self.quantized = QuantizedProducts(int_gemm=int_gemm, int8_activations=int8_activations,
                                           one_attention=one_attention, blas_on_numba_pool=self.blas_on_numba_pool,
                                           max_threads=self.max_threads)

    def begin_step(self) -> None:
        if self._governor is not None and (n := self._governor.update()) != self.threads:
            numba.set_num_threads(n)
            self.threads = n

    def after_warm_up(self) -> None:
        if self._governor is not None:     # the warm-up's compile helper is no other program taking a core
            numba.set_num_threads(self._governor.reset())
            self.threads = self.max_threads

    def kv_dtype(self, model_dtype: str, choice: str = "auto", quant: str | None = None) -> np.dtype:
        # Decode attention streams every cached K/V row each step: float16 halves those bytes, int8 (a
        # float32 scale per row of head_dim values) brings them to (head_dim + 4) / (4 head_dim). auto:
        # int8 for int8 models, built for many sequences, whose golden agreement holds with it
        # (tests/backend/test_quant.py); float16 for q4 models, built for one stream, whose agreement
        # is best with it (test_q4.py: the int8 cache's rounding flips near-ties that float16 keeps);
        # float32 for float models and fp8 ones (the reference path), exact. float16 converts with F16C
        # where the CPU has it, else in integer operations with the same results (half.py).
        if choice == "auto":
            choice = "float32" if quant in (None, "fp8") else "float16" if quant == "q4" else "int8"
        return np.dtype(choice)

    # ---- memory (memory.py) ------------------------------------------------------------------
    def alloc_arena(self, nbytes: int):
        return cpu_memory.anonymous_arena(nbytes)

    def prefault(self, arena, offset, nbytes) -> None:
        cpu_memory.populate(arena, offset, nbytes, self.threads)

    def upload(self, dst, src) -> None:
        src = np.asarray(src)
        if src.shape != dst.shape:
            raise ValueError(f"upload: source shape {src.shape} does not match destination {dst.shape}")
        np.copyto(dst, src, casting="unsafe")

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    # ---- layer ops ---------------------------------------------------------------------------
    def embedding(self, ids, table, out, scale=1.0) -> None:
        shapes.embedding(ids, table.shape, out)
        check_array("ids", ids, np.int32)
        check_array("out", out)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise ValueError(f"token id out of range [0, {table.shape[0]})")
        if isinstance(table, Int8Weight):
            K.int8_embedding_kernel(ids, table.q, table.scale, out)
        else:
            K.take_rows_kernel(table, ids, out)
        if scale != 1.0:
            out *= np.float32(scale)

    def rmsnorm(self, x, weight, eps, out) -> None:
        shapes.norm("rmsnorm", x, weight, out)
        check_array("x", x)
        check_array("out", out)
        K.rmsnorm_kernel(x.shape[0], x, weight, np.float32(eps), out)

    def add_rmsnorm(self, x, residual, weight, eps, out) -> None:
        shapes.norm("add_rmsnorm", x, weight, out, residual)
        check_array("x", x)
        check_array("residual", residual, np.float32)
        check_array("out", out)
        K.add_rmsnorm_kernel(x.shape[0], x, residual, weight, np.float32(eps), out)

    def linear(self, x, w, out, bias=None, scratch=None) -> None:
        shapes.linear(x, w.shape, out, bias)
        check_array("x", x, np.float32)              # BLAS and the int8 quantizer read it as raw float32
        check_array("out", out)
        if isinstance(w, (Int8Weight, Q4Weight)):
            self.quantized.linear(x, w, out, scratch)
        else:
            parts = max(1, min(self.max_threads, w.shape[0] // 64))
            few = self.one_attention or x.shape[0] <= cpu_fgemm.DEFAULT_MAX_ROWS
            if w.dtype == np.float32 and few and cpu_fgemm.available():
                # the row-invariant GEMM: as fast as BLAS's GEMV at one row, faster up to DEFAULT_MAX_ROWS,
                # slower above (prefill), where the batch-invariant mode alone takes it (docs/kernels.md)
                cpu_fgemm.matmul_nt(x, w, out, parts)
            elif w.dtype == np.float32 and few:
                cpu_rows.rows_matmul_f32(x, w, out, parts)     # the same invariance without fgemm (rows.py)
            elif self.blas_on_numba_pool:
                cpu_blas.matmul_nt(x, w, out, parts)
            else:
                # NOTE: w.T is a transposed view; NumPy hands it to BLAS as a transpose flag, no copy.
                np.matmul(x, w.T, out=out)
        if bias is not None:
            out += bias

    def prepare_weight(self, w, head: bool = False):
        if isinstance(w, Fp8Weight):            # the reference path: float32 weights from here on
            return dequantize_fp8(w.q, w.scale)
        return self.quantized.prepare_weight(w, head)

    def linear_silu_mul(self, x, w, gate_up, out, scratch=None) -> None:
        if not self.quantized.linear_silu_mul(x, w, out, scratch):
            super().linear_silu_mul(x, w, gate_up, out, scratch)

    def rope(self, qkv, positions, cos_sin, num_heads, num_kv_heads) -> None:
        _, D = shapes.rope(qkv, positions, cos_sin, num_heads, num_kv_heads)
        check_array("qkv", qkv)
        check_array("positions", positions, np.int32)
        if positions.size and (positions.min() < 0 or positions.max() >= cos_sin.shape[0]):
            raise ValueError(f"position out of range [0, {cos_sin.shape[0]}): the model's context is exceeded")
        K.rope_kernel(qkv.shape[0], qkv, positions, cos_sin, num_heads, num_kv_heads, D)

    def head_rmsnorm(self, qkv, q_weight, k_weight, eps, num_heads, num_kv_heads) -> None:
        shapes.head_rmsnorm(qkv, q_weight, k_weight, num_heads, num_kv_heads)
        check_array("qkv", qkv, np.float32)
        V.head_rmsnorm_kernel(qkv.shape[0], qkv, q_weight, k_weight, np.float32(eps), num_heads, num_kv_heads)

    def gelu_tanh_mul(self, gate_up, out) -> None:
        shapes.silu_mul(gate_up, out, op="gelu_tanh_mul")
        check_array("gate_up", gate_up)
        check_array("out", out)
        V.gelu_tanh_mul_kernel(gate_up.shape[0], gate_up, out)

    def silu_mul(self, gate_up, out) -> None:
        shapes.silu_mul(gate_up, out)
        check_array("gate_up", gate_up)
        check_array("out", out)
        K.silu_mul_kernel(gate_up.shape[0], gate_up, out)

    def kv_write(self, qkv, k_cache, v_cache, slot_mapping, num_heads) -> None:
        shapes.kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)
        check_array("qkv", qkv)
        check_array("slot_mapping", slot_mapping, np.int32)
        K.kv_write_kernel(qkv.shape[0], qkv, _kv(k_cache), _kv(v_cache), slot_mapping, num_heads)

    def paged_attention_decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               scale, out, max_context_len, window=0) -> None:
        B, H, Hkv = self._attention_args("paged_attention_decode", qkv, k_cache, v_cache, block_tables,
                                         context_lens, query_start_loc, out)
        k_cache, v_cache = _kv(k_cache), _kv(v_cache)
        kernel = A.decode_attention_avx2_kernel if A.decode_attention_avx2_fits(k_cache) else A.decode_attention_kernel
        if self.one_attention:           # the build _per_query runs: the serial one may round differently
            kernel.parallel(qkv, k_cache, v_cache, block_tables, context_lens, np.float32(scale), H, int(window), out)
            return
        kernel(B * Hkv, qkv, k_cache, v_cache, block_tables, context_lens, np.float32(scale), H, int(window), out)

    def paged_attention_prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale, out, max_query_len, window=0) -> None:
        _, H, Hkv = self._attention_args("paged_attention_prefill", qkv, k_cache, v_cache, block_tables,
                                         context_lens, query_start_loc, out)
        k_cache, v_cache = _kv(k_cache), _kv(v_cache)
        # NOTE: each sequence takes the kernel its own query count picks (one query: the decode kernel;
        # ATTN_BLAS_MIN_QUERY or more: tileattn.py where it fits the layer, else the products on BLAS; else
        # the tiled kernel), not one the rest of the batch picks: the kernels round differently, and a
        # request's output must not depend on its batch. Every kernel computes each (query tile, kv head)
        # work item on its own. tileattn needs no BLAS: it takes long runs under MKL too.
        q_lens = np.diff(query_start_loc)
        if self.one_attention:
            return self._per_query(q_lens, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                   scale, H, Hkv, window, out)
        one, tiled = q_lens == 1, self.tile_attention and cpu_tileattn.supports(k_cache.shape[3], window)
        long = q_lens >= ATTN_BLAS_MIN_QUERY if tiled or self.blas_on_numba_pool else np.zeros_like(one)
        if one.any():
            self._decode_rows(np.flatnonzero(one), qkv, k_cache, v_cache, block_tables, context_lens,
                              query_start_loc, scale, H, Hkv, window, out)
        if long.any():
            seqs, q0, q1 = _items_of(long, query_start_loc, ATTN_BLAS_QUERY_TILE)
            if tiled:
                cpu_tileattn.attend(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, long, seqs,
                                    q0, q1, scale, H, out, self.max_threads)
            else:
                cpu_blas.prefill_attention(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, seqs,
                                           q0, q1, np.float32(scale), H, int(window), out, self.max_threads)
        if (short := ~(one | long)).any():
            seqs, q0, q1 = _items_of(short, query_start_loc, ATTN_QUERY_TILE)   # [W] each
            A.paged_attention_kernel(len(seqs) * Hkv, qkv, k_cache, v_cache, block_tables, context_lens,
                                     query_start_loc, seqs, q0, q1, np.float32(scale), H, int(window), out)

    @staticmethod
    def _per_query(q_lens, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, H, Hkv,
                   window, out) -> None:
        """Batch-invariant attention: every query as a one-query sequence of the decode kernel (its own
        block table row, its position + 1 keys visible), so its bits do not depend on how many queries of
        its sequence run in this step (a prefix-cache hit, a chunk boundary, a preemption's recompute).
        Always its parallel build, whatever the row count, as the fused int8 decode does: the serial and
        parallel builds are compiled apart and need not round alike."""
        T = int(query_start_loc[-1])
        seq_of = np.repeat(np.arange(len(q_lens)), q_lens)
        offset = np.arange(T) - query_start_loc[:-1][seq_of]          # the query's index in its run
        visible = (context_lens[seq_of] - q_lens[seq_of] + offset + 1).astype(np.int32)
        kernel = A.decode_attention_avx2_kernel if A.decode_attention_avx2_fits(k_cache) else A.decode_attention_kernel
        o = np.empty((T, out.shape[1]), out.dtype)
        kernel.parallel(np.ascontiguousarray(qkv[:T]), k_cache, v_cache, np.ascontiguousarray(block_tables[seq_of]),
                        visible, np.float32(scale), H, int(window), o)
        out[:T] = o

    @staticmethod
    def _decode_rows(seqs, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, H, Hkv,
                     window, out) -> None:
        """Attention of the one-query sequences `seqs` of a mixed batch through the decode kernel, on
        gathered rows (the kernel takes row b as sequence b)."""
        rows = query_start_loc[seqs]
        o = np.empty((len(seqs), out.shape[1]), out.dtype)
        kernel = A.decode_attention_avx2_kernel if A.decode_attention_avx2_fits(k_cache) else A.decode_attention_kernel
        kernel(len(seqs) * Hkv, np.ascontiguousarray(qkv[rows]), k_cache, v_cache,
               np.ascontiguousarray(block_tables[seqs]), np.ascontiguousarray(context_lens[seqs]), np.float32(scale),
               H, int(window), o)
        out[rows] = o

    @staticmethod
    def _attention_args(op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out):
        """(B, H, Hkv) of an attention call, after checking its shapes and what the kernels read raw:
        contiguous rows, int32 metadata."""
        _, B, H, Hkv, _ = shapes.attention(op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                           out)
        check_array("qkv", qkv)
        check_array("out", out)
        check_array("block_tables", block_tables, np.int32)
        check_array("context_lens", context_lens, np.int32)
        check_array("query_start_loc", query_start_loc, np.int32)
        return B, H, Hkv

    def fused_plan(self, layers, k_caches, v_caches, gelu=False):
        """The per-layer tensors as typed lists (built once), so one Numba call can walk every layer."""
        def typed(arrays):
            out = cpu_fused.list_of(arrays[0])
            for a in arrays[1:]:
                cpu_fused.push(out, a)
            return out
        mats = (("qkv", "qkv_proj"), ("o", "o_proj"), ("gu", "gate_up_proj"), ("down", "down_proj"))
        cols = {f"{kind}_{short}s": [] for short, _ in mats for kind in ("w", "s", "p")}
        for L in layers:
            for short, name in mats:
                w = getattr(L, name)
                if isinstance(w, np.ndarray):               # float32: the batched kernel's fgemm reads W
                    a, b, packed = w, NO_BIAS, w
                else:                                       # fused.weight_matvec takes int8 or q4
                    a, b = q4_parts(w) if isinstance(w, Q4Weight) else (w.q, w.scale)
                    packed = w.packed
                cols[f"w_{short}s"].append(a)
                cols[f"s_{short}s"].append(b)
                cols[f"p_{short}s"].append(packed)
        # the batched kernel (p_*) when every matrix has a packed copy, all of one kind per list (a typed
        # list holds one array type), else the few-row kernel (w_*); s_* for either
        packed = all(p is not None for short, _ in mats for p in cols[f"p_{short}s"]) and \
            all(len({(p.dtype, p.ndim) for p in cols[f"p_{short}s"]}) == 1 for short, _ in mats)
        plan = {k: typed(v) for k, v in cols.items() if k[0] == "s" or (k[0] == "p") == packed}
        plan["packed"] = packed                             # batched decode: integer GEMMs on the packed copies
        plan["a8"] = packed and self.int8_activations       # then every int8 matrix is packed for a8gemm
        plan["in_norms"] = typed([L.input_norm for L in layers])
        plan["post_norms"] = typed([L.post_attn_norm for L in layers])
        plan["b_qkvs"] = typed([L.qkv_bias if L.qkv_bias is not None else NO_BIAS for L in layers])
        plan["k_caches"], plan["v_caches"] = typed([_kv(c) for c in k_caches]), typed([_kv(c) for c in v_caches])
        plan["avx2_attention"] = True if A.decode_attention_avx2_fits(_kv(k_caches[0])) else None   # fused.py
        plan["windows"] = np.array([L.window for L in layers], np.int64)
        plan["max_k"] = max(getattr(L, name).shape[1] for L in layers for _, name in mats)
        plan["float"] = isinstance(layers[0].qkv_proj, np.ndarray)
        for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):   # family ops (empty: none)
            plan[name + "s"] = typed([NO_BIAS if getattr(L, name) is None else getattr(L, name) for L in layers])
        if all(L.q_norm is None for L in layers):           # no head norms: None, so fused.py compiles none
            plan["q_norms"] = plan["k_norms"] = None
        plan["cos_sins"] = typed([L.cos_sin for L in layers])
        plan["gelu"] = True if gelu else None
        # the few-row kernel (decoder_stack_kernel) runs the Llama layer only
        plan["llama"] = not gelu and all(L.q_norm is None and L.attn_out_norm is None and L.mlp_out_norm is None
                                         and L.cos_sin is layers[0].cos_sin for L in layers)
        return plan

    def fused_limits(self, plan) -> tuple[int, int]:
        # int8 / q4 with packed weights: every pure decode batch, whatever its size, in one call on the
        # integer GEMMs, and nothing else fused: a row then takes the same kernels alone or in any batch
        # (the matrix-vector kernels round differently). Otherwise (unpacked): pure decode batches of a
        # few rows on the per-op path's kernels (the decode attention too); none with one_attention.
        # float32: pure decode batches the per-op path gives fgemm too (every row count with one_attention).
        # Families other than Llama (plan["llama"] false) take the batched kernel alone.
        if plan["float"]:
            return 0, (1 << 30) if self.one_attention else cpu_fgemm.DEFAULT_MAX_ROWS
        if plan["packed"]:
            return 0, 1 << 30
        return (0, 0) if self.one_attention or self.int8_activations or not plan["llama"] else (0, INT8_GEMV_MAX_ROWS)

    def decoder_layers(self, plan, acts, T, batch, cos_sin, eps, scale, num_heads, num_kv_heads) -> None:
        for name in ("positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc"):
            check_array(name, getattr(batch, name), np.int32)
        p = plan
        if batch.max_query_len != 1 or (T > INT8_GEMV_MAX_ROWS and not p["packed"]):   # see fused_limits
            raise ValueError(f"decoder_layers takes a pure decode batch: of any size for a model with packed "
                             f"weights, of at most {INT8_GEMV_MAX_ROWS} sequences for another quantized model; "
                             f"got {T} tokens")
        if p["packed"]:
            qx, qs, qb = (self.quantized.a8_buffers if p["a8"] else self.quantized.q4_gemm_buffers)(T, p["max_k"])
            decoder_stack_batched_kernel(
                acts.hidden[:T], acts.residual[:T], acts.normed[:T], acts.qkv[:T], acts.attn[:T], acts.gate_up[:T],
                acts.act[:T],
                p["in_norms"], p["p_qkvs"], p["s_qkvs"], p["b_qkvs"], p["p_os"], p["s_os"], p["post_norms"],
                p["p_gus"], p["s_gus"], p["p_downs"], p["s_downs"], batch.positions, batch.slot_mapping,
                batch.block_tables, batch.context_lens, p["k_caches"], p["v_caches"], p["cos_sins"],
                np.float32(eps), np.float32(scale), num_heads, num_kv_heads, qx, qs, qb, p["avx2_attention"],
                p["windows"], self.max_threads, p["q_norms"], p["k_norms"], p["attn_out_norms"],
                p["mlp_out_norms"], p["gelu"])
            return
        decoder_stack_kernel(
            acts.hidden[:T], acts.residual[:T], acts.normed[:T], acts.qkv[:T], acts.attn[:T], acts.gate_up[:T],
            acts.act[:T],
            p["in_norms"], p["w_qkvs"], p["s_qkvs"], p["b_qkvs"], p["w_os"], p["s_os"], p["post_norms"],
            p["w_gus"], p["s_gus"], p["w_downs"], p["s_downs"], batch.positions, batch.slot_mapping,
            batch.block_tables, batch.context_lens, p["k_caches"], p["v_caches"],
            cos_sin, np.float32(eps), np.float32(scale), num_heads, num_kv_heads, p["avx2_attention"], p["windows"])

    def copy_blocks(self, k_caches, v_caches, pairs) -> None:
        if not pairs:
            return
        src = np.asarray([p[0] for p in pairs], np.int64)
        dst = np.asarray([p[1] for p in pairs], np.int64)
        for cache in list(k_caches) + list(v_caches):
            K.copy_blocks_kernel(_kv(cache), src, dst)

    def take_rows(self, x, indices, out) -> None:
        shapes.take_rows(x, indices, out)
        check_array("out", out)
        K.take_rows_kernel(x, indices, out)
