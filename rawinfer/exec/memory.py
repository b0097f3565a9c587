"""The memory pool: one arena allocated once, carved into weights, workspace and KV blocks.

    arena (one backend allocation, 256-byte aligned regions)
    +-----------------------------+------------------------------+---------------------------------+
    | weights                     | workspace                    | KV blocks                       |
    | embed, per-layer tensors,   | activation buffers sized for | per layer: k_cache, v_cache     |
    | final norm, lm head, RoPE   | max_num_batched_tokens rows  | each [NB (+1), Hkv, BS, D]      |
    | cos/sin table               | + logits rows; on CUDA also  |                                 |
    |                             | the decode split-K scratch   |                                 |
    |                             | and the decode-graph inputs  |                                 |
    +-----------------------------+------------------------------+---------------------------------+

Sizing.  The weights and the workspace have fixed sizes; the KV region gets `--kv-cache-memory` when
it is given.  Otherwise: on the CPU 1 GiB; on a GPU the whole pool is gpu_memory_utilization x the
free device memory at start (one cudaMalloc), and the KV region is what the weights and the workspace
leave of it.  Asked for a padding block (decode graphs), the KV region holds one block more than the
block manager hands out: the padding rows of a decode graph write their K/V into it.

A guest.  A speculative draft model's pool can live in the same arena, after the KV blocks: the host is
built with guest=GuestPool (what the guest's own plan needs, MemoryPool.guest_request), takes the guest's
weights and workspace out of its budget, and shares its KV region so that both models hold the same number
of tokens; the guest's MemoryPool(region=host.guest_region, kv_bytes=host.guest_kv_bytes) carves that room.

Who asks for what.  The backend names the scratch its decode attention needs
(attention_workspace_bytes); the pool carves it and binds it to the backend right away.  The runner
names any further workspace regions it needs (the decode-graph inputs, exec/graphs.py) as
(shape, dtype) pairs; the pool carves them without knowing what they hold.

KV layout of one layer's k_cache (v_cache is the same):

    block 0                          block 1
    | kv head 0: BS rows x D | kv head 1: BS rows x D | ... | kv head 0: BS rows x D | ...

A thread block of the decode kernel that owns (sequence, kv head) streams BS x D contiguous values per
block-table entry, which is the access pattern the GPU kernels are written for (see backend/base.py).

Nothing else allocates a large buffer while the engine runs: the model writes every activation into
the workspace views and every K/V into the KV region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rawinfer.backend.base import Activations
from rawinfer.config import EngineConfig, ModelConfig, resolve_max_model_len
from rawinfer.exec import weights as W
from rawinfer.exec.weights import weight_plan, weight_shapes  # noqa: F401  (re-exported: tools, benchmarks)

ALIGN = 256
CPU_KV_CACHE_BYTES = 1024**3        # the KV region on the CPU when --kv-cache-memory is not given
DEQUANT_TILE_ROWS = 8192


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(shape, dtype) -> int:
    return _align(int(np.prod(shape)) * np.dtype(dtype).itemsize)


def dequant_scratch_size(cfg: ModelConfig) -> int:
    """Floats of scratch for quantized GEMMs on BLAS: the largest matrix, its rows capped at DEQUANT_TILE_ROWS."""
    if cfg.quant is None:
        return 0
    return max(min(s[0], DEQUANT_TILE_ROWS) * s[1] for s in weight_shapes(cfg).values() if len(s) == 2)


def max_blocks_per_seq(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """MB: the most KV blocks one sequence can own."""
    return -(-resolve_max_model_len(cfg, ecfg) // ecfg.block_size)


def kv_region_bytes(ecfg: EngineConfig, fixed_bytes: int, free_device_bytes: int | None,
                    rope_bytes: int = 0) -> tuple[int, str]:
    """(bytes for the KV region, how they were chosen).  fixed_bytes: weights + workspace, of which
    rope_bytes are the RoPE tables; free_device_bytes: free GPU memory, or None on the CPU."""
    mib = 1024**2
    if ecfg.kv_cache_memory is not None:
        return ecfg.kv_cache_memory, "--kv-cache-memory"
    if free_device_bytes is None:
        return CPU_KV_CACHE_BYTES, "the CPU default"
    budget = int(float(ecfg.gpu_memory_utilization) * free_device_bytes)
    if budget <= fixed_bytes:
        # the RoPE tables grow with the context, not with the model: past half the total only a
        # shorter context makes it fit
        rope = rope_bytes * 2 > fixed_bytes
        raise ValueError(
            f"the model's weights and workspace need {fixed_bytes / mib:.0f} MiB"
            f"{f' ({rope_bytes / mib:.0f} MiB of it the RoPE cos/sin table)' if rope else ''} but "
            f"gpu_memory_utilization {ecfg.gpu_memory_utilization} of the {free_device_bytes / mib:.0f} MiB free "
            f"on the GPU is {budget / mib:.0f} MiB; "
            + ("give a smaller --max-model-len (it caps the RoPE table's positions)" if rope
               else "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or free the GPU"))
    return budget - fixed_bytes, (f"gpu_memory_utilization {ecfg.gpu_memory_utilization} x "
                                  f"{free_device_bytes / mib:.0f} MiB free")


def available_host_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def alloc_arena(backend, nbytes: int, kv_bytes: int, kv_sizing: str, ws_bytes: int = 0, rope_bytes: int = 0,
                rope_rows: int = 0):
    """backend.alloc_arena(nbytes), or a ValueError of one sentence when the machine lacks the memory.
    On the CPU the size is checked first: the KV region is mapped in right after, and a mapping larger
    than the free memory would be granted and then end in swapping or the out-of-memory killer.
    rope_bytes: the RoPE cos/sin tables' share of the weights, one row per position (rope_rows)."""
    gib = 1024**3
    rope = (f"{rope_bytes / gib:.1f} GiB of RoPE cos/sin table for {rope_rows} positions, "
            if rope_bytes >= gib / 20 else "")        # named where it shows at this precision
    what = (f"the memory pool needs {nbytes / gib:.1f} GiB (of it {rope}{kv_bytes / gib:.1f} GiB of KV cache, "
            f"sized by {kv_sizing}, and {ws_bytes / gib:.1f} GiB of workspace)")
    if rope_bytes > max(kv_bytes, ws_bytes):   # a huge context: the table ends at max_model_len
        fix = ("give a smaller --max-model-len (it caps the RoPE table's positions, the model's whole context "
               "by default)")
    elif ws_bytes > kv_bytes:   # the activations for max_num_batched_tokens rows and logits for max_num_seqs
        fix = "give a smaller --max-num-batched-tokens or --max-num-seqs (they size the workspace)"
    else:
        fix = "give a smaller --kv-cache-memory" + ("" if kv_sizing == "--kv-cache-memory" else " (e.g. 512MiB)")
    if not backend.capabilities.on_gpu:
        free = available_host_memory()
        if free is not None and nbytes > free:
            raise ValueError(f"{what} but this machine has {free / gib:.1f} GiB of memory available; {fix}")
    try:
        return backend.alloc_arena(nbytes)
    except MemoryError:                 # numpy's _ArrayMemoryError, CuPy's OutOfMemoryError
        where = "the GPU" if backend.capabilities.on_gpu else "this machine"
        raise ValueError(f"{what} but {where} could not allocate it; {fix}") from None


@dataclass
class Workspace:
    """Activation buffers for up to T = max_num_batched_tokens rows and S logits rows."""
    acts: Activations  # [T, ...] the layer activations (backend/base.py)
    last: Any          # [S, C]  hidden rows that need logits
    logits: Any        # [S, V]  float32
    dequant: Any       # flat float32: quantized weight rows dequantized for a BLAS GEMM (empty unless quantized)
    attention: Any = None                                 # flat uint8: the backend's decode attention scratch
    extra: dict[str, Any] = field(default_factory=dict)   # the runner's own regions, by name


@dataclass
class KVCache:
    k: list[Any] = field(default_factory=list)   # L x [NB (+1), Hkv, BS, D]
    v: list[Any] = field(default_factory=list)   # L x [NB (+1), Hkv, BS, D]
    num_blocks: int = 0                          # NB: the blocks the block manager hands out
    block_size: int = 16
    padding_block: int | None = None             # block NB, written only by decode-graph padding rows

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def read_blocks(self, xp, layer: int, block_ids: list[int]) -> np.ndarray:
        """Host copy of one layer's K and V of block_ids: [2, n, Hkv, R, D] in the cache's storage dtype
        (raw bytes, int8 scale rows included). xp: the backend's array module (a GPU copy goes to the host)."""
        ids = xp.asarray(block_ids, dtype=xp.int64)
        kv = xp.stack([self.k[layer][ids], self.v[layer][ids]])
        return kv if xp is np else xp.asnumpy(kv)

    def write_blocks(self, xp, layer: int, block_ids: list[int], data: np.ndarray) -> None:
        """Store read_blocks' array (same shape, storage dtype) into one layer's block_ids."""
        want = (2, len(block_ids)) + tuple(self.k[layer].shape[1:])
        if tuple(data.shape) != want or data.dtype != self.k[layer].dtype:
            raise ValueError(f"KV data of shape {tuple(data.shape)} {data.dtype} does not fit {want} "
                             f"{self.k[layer].dtype}")
        ids = xp.asarray(block_ids, dtype=xp.int64)
        src = data if xp is np else xp.asarray(data)
        self.k[layer][ids] = src[0]
        self.v[layer][ids] = src[1]


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype) -> tuple:
    """Shape of one layer's K (or V) cache: [blocks, kv heads, tokens, head_dim]. An int8 cache (CPU)
    adds ceil(4 * block_size / head_dim) rows to each (block, kv head) tile for its tokens' float32
    scales (rawinfer/backend/cpu/kernels.py: KV cache element access)."""
    rows = block_size
    if np.dtype(dtype) == np.int8:
        rows += -(-4 * block_size // head_dim)
    return (num_blocks, num_kv_heads, rows, head_dim)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    shape = kv_cache_shape(1, cfg.num_kv_heads, block_size, cfg.head_dim, dtype)
    return cfg.num_layers * 2 * int(np.prod(shape)) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class GuestPool:
    """A second model's pool to be carved inside this one's arena (a speculative draft model, engine/draft.py):
    its weights and workspace (fixed_bytes), and KV blocks of block_bytes each, spare_blocks more than it hands
    out; slack covers its per-layer alignment. owner is the caller's own, kept as given."""
    fixed_bytes: int
    block_bytes: int
    spare_blocks: int
    slack: int
    owner: Any = None


class MemoryPool:
    """Owns the arena and every typed view carved out of it.

    region (arena, offset, nbytes): carve inside that part of another pool's arena instead of allocating.
    guest (GuestPool): leave room after this pool's KV region for a second model's pool; the KV region, however
    it is sized, is then shared so that both models hold the same number of tokens, and guest_region,
    guest_kv_bytes say where the guest carves and how much KV it gets (one allocation serves both)."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, backend, *, padding_block: bool = False,
                 extra_workspace: dict[str, tuple[tuple[int, ...], Any]] | None = None,
                 logits_rows: int | None = None, kv_bytes: int | None = None,
                 region: tuple[Any, int, int] | None = None, guest: GuestPool | None = None):
        self.cfg, self.ecfg, self.backend = cfg, ecfg, backend
        self._plan(padding_block, extra_workspace, logits_rows)
        self._size_kv(kv_bytes, guest, region is not None)
        self._allocate(region)

    @classmethod
    def guest_request(cls, cfg: ModelConfig, ecfg: EngineConfig, backend, *, padding_block: bool = False,
                      extra_workspace: dict | None = None, owner: Any = None) -> GuestPool:
        """What a pool of these options needs as another pool's guest (nothing is allocated)."""
        pool = cls.__new__(cls)
        pool.cfg, pool.ecfg, pool.backend = cfg, ecfg, backend
        pool._plan(padding_block, extra_workspace, None)
        return GuestPool(fixed_bytes=pool.weight_bytes + pool.workspace_bytes, block_bytes=pool._per_block,
                         spare_blocks=pool._spare, slack=2 * cfg.num_layers * ALIGN, owner=owner)

    def _plan(self, padding_block: bool, extra_workspace: dict | None, logits_rows: int | None) -> None:
        """Every region's (name, shape, dtype) and the fixed (weights + workspace) bytes; nothing allocated."""
        cfg, ecfg, backend = self.cfg, self.ecfg, self.backend
        wdt = backend.weight_dtype(cfg.dtype)
        adt = backend.activation_dtype(cfg.dtype)
        self._kdt = kdt = backend.kv_dtype(cfg.dtype, ecfg.kv_cache_dtype, cfg.quant)
        T = ecfg.max_num_batched_tokens
        S = logits_rows or max(ecfg.max_num_seqs, 1)
        self.max_tokens, self.logits_rows = T, S
        C, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        MB = max_blocks_per_seq(cfg, ecfg)
        self.max_blocks_per_seq = MB
        self.max_context_len = MB * ecfg.block_size   # the longest context any step may have
        # RoPE tables (cos | sin) for every position a step may reach: the model's, and the sliding
        # layers' own where their RoPE differs (Gemma 3)
        self._rope_rows = min(cfg.max_position_embeddings, self.max_context_len)
        self._ropes = {"rope_cos_sin": cfg.rope}
        if cfg.rope_local is not None:
            self._ropes["rope_cos_sin_local"] = cfg.rope_local
        self._weight_plan = weight_plan(cfg, wdt)
        self._weight_plan += [(name, (self._rope_rows, cfg.head_dim), np.float32) for name in self._ropes]
        self._act_plan = [("hidden", (T, C), adt), ("residual", (T, C), np.float32), ("normed", (T, C), adt),
                          ("qkv", (T, cfg.qkv_size), adt), ("attn", (T, cfg.q_size), adt),
                          ("gate_up", (T, 2 * F), adt), ("act", (T, F), adt)]
        self._ws_plan = [("last", (S, C), adt), ("logits", (S, V), np.float32),
                         ("dequant", (dequant_scratch_size(cfg),), np.float32)]
        # every decode batch (B <= max_num_seqs, contexts <= MB * BS) fits: no allocation while serving
        attn_bytes = backend.attention_workspace_bytes(ecfg.max_num_seqs, cfg.num_heads, cfg.head_dim,
                                                       ecfg.block_size, self.max_context_len,
                                                       np.dtype(kdt).itemsize, cfg.num_kv_heads)
        if attn_bytes:
            self._ws_plan.append(("attention", (attn_bytes,), np.uint8))
        self._extra_plan = [(name, tuple(shape), dt) for name, (shape, dt) in (extra_workspace or {}).items()]
        self.weight_bytes = sum(_nbytes(s, d) for _, s, d in self._weight_plan)
        self._rope_bytes = len(self._ropes) * _nbytes((self._rope_rows, cfg.head_dim), np.float32)
        self.workspace_bytes = sum(_nbytes(s, d) for _, s, d in self._act_plan + self._ws_plan + self._extra_plan)
        self._per_block = kv_bytes_per_block(cfg, ecfg.block_size, kdt)
        self._spare = 1 if padding_block else 0

    def _size_kv(self, kv_bytes: int | None, guest: GuestPool | None, carved: bool = False) -> None:
        """The KV region's blocks (and a guest's share of it) and the pool's total bytes. carved: this pool is
        another's guest, its KV bytes that pool's share for it."""
        fixed = self.weight_bytes + self.workspace_bytes
        guest_fixed = guest.fixed_bytes + guest.slack if guest is not None else 0
        if kv_bytes is None:
            free = self.backend.device_memory_info()[0] if self.backend.capabilities.on_gpu else None
            kv_bytes, self.kv_sizing = kv_region_bytes(self.ecfg, fixed + guest_fixed, free, self._rope_bytes)
        else:
            self.kv_sizing = "the host pool (as many tokens as its model)" if carved else "the caller"
        per_block, spare = self._per_block, self._spare
        if guest is None:
            num_blocks = kv_bytes // per_block - spare
        else:   # blocks of both models for the same tokens: a guest never runs out before its host
            shared = kv_bytes - spare * per_block - guest.spare_blocks * guest.block_bytes
            num_blocks = shared // (per_block + guest.block_bytes)
        if num_blocks < 1:
            both = " and the draft model's" if guest is not None else ""
            raise ValueError(
                f"the KV region ({kv_bytes} bytes, from {self.kv_sizing}) holds no KV block (one block of "
                f"{self.ecfg.block_size} tokens needs {per_block} bytes for this model{both}"
                f"{', and decode graphs reserve one more' if spare else ''}); give --kv-cache-memory more, e.g. 1GiB")
        self._num_blocks = num_blocks
        layer_bytes = _align((num_blocks + spare) * per_block // (2 * self.cfg.num_layers))   # one k or v tensor
        self.kv_bytes = 2 * self.cfg.num_layers * layer_bytes
        self.guest, self.guest_kv_bytes, self.guest_bytes = guest, 0, 0
        if guest is not None:
            self.guest_kv_bytes = (num_blocks + guest.spare_blocks) * guest.block_bytes
            self.guest_bytes = _align(guest_fixed + self.guest_kv_bytes)
        self.total_bytes = fixed + self.kv_bytes + self.guest_bytes

    def _allocate(self, region: tuple[Any, int, int] | None) -> None:
        """Allocate the arena (or take region of another's) and carve every region out of it in plan order."""
        cfg, backend, spare = self.cfg, self.backend, self._spare
        if region is None:
            self.arena = alloc_arena(backend, self.total_bytes, self.kv_bytes + self.guest_kv_bytes, self.kv_sizing,
                                     self.workspace_bytes, self._rope_bytes, self._rope_rows)
            self._offset = 0
        else:
            self.arena, self._offset, room = region
            if self.total_bytes > room:
                raise ValueError(f"a pool of {self.total_bytes} bytes does not fit the {room} bytes its host "
                                 "reserved for it; size it with MemoryPool.guest_request and the host's guest_kv_bytes")
        base = self._offset
        self.weights: dict[str, Any] = {name: self._carve(shape, dt) for name, shape, dt in self._weight_plan}
        acts = Activations(**{name: self._carve(shape, dt) for name, shape, dt in self._act_plan})
        bufs = {name: self._carve(shape, dt) for name, shape, dt in self._ws_plan}
        extra = {name: self._carve(shape, dt) for name, shape, dt in self._extra_plan}
        self.workspace = Workspace(acts=acts, extra=extra, **bufs)
        if self.workspace.attention is not None:   # bound once: decode attention allocates nothing per step
            backend.bind_attention_workspace(self.workspace.attention)
        num_blocks = self._num_blocks
        self.kv = KVCache(num_blocks=num_blocks, block_size=self.ecfg.block_size,
                          padding_block=num_blocks if spare else None)
        kv_shape = kv_cache_shape(num_blocks + spare, cfg.num_kv_heads, self.ecfg.block_size, cfg.head_dim,
                                  self._kdt)
        self._kv_offset = self._offset
        for _ in range(cfg.num_layers):
            self.kv.k.append(self._carve(kv_shape, self._kdt))
            self.kv.v.append(self._carve(kv_shape, self._kdt))
        assert self._offset == base + self.total_bytes - self.guest_bytes
        self.guest_region = (self.arena, self._offset, self.guest_bytes) if self.guest is not None else None
        for name, rope in self._ropes.items():
            backend.upload(self.weights[name], W.rope_cos_sin(cfg, rope, self._rope_rows))

    def _carve(self, shape, dtype):
        view = self.backend.carve(self.arena, self._offset, shape, dtype)
        self._offset += _nbytes(shape, dtype)
        return view

    def prefault_kv(self) -> None:
        """Map the KV region in now, so that no kernel step pays for first-touch page faults. Called
        once the weights are in: the checkpoint's file mapping is gone by then, so the two never add
        up in resident memory."""
        self.backend.prefault(self.arena, self._kv_offset, self.kv_bytes)

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, model_dir: str) -> None:
        """Copy model.safetensors into the weight region tensor by tensor (checks names and shapes)."""
        W.load_weights(self.cfg, model_dir, self.weights, self.backend.upload)

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (norms = 1) for benchmarks and tests of models that have no checkpoint."""
        W.init_random_weights(self.cfg, self.weights, self.backend.upload, seed, std)

    def describe(self) -> str:
        mib = 1024**2
        attn = self.workspace.attention
        extra = f", {attn.nbytes / mib:.0f} MiB of it decode attention scratch" if attn is not None else ""
        spare = " + 1 padding block for decode graphs" if self.kv.padding_block is not None else ""
        return (f"memory pool: {self.total_bytes / mib:.0f} MiB = weights {self.weight_bytes / mib:.0f} MiB + "
                f"workspace {self.workspace_bytes / mib:.0f} MiB{extra} + KV {self.kv_bytes / mib:.0f} MiB "
                f"sized by {self.kv_sizing} ({self.kv.num_blocks} blocks x {self.kv.block_size} tokens = "
                f"{self.kv.num_tokens} tokens of {np.dtype(self.kv.k[0].dtype).name} KV{spare})"
                + (f" + {self.guest_bytes / mib:.0f} MiB for the draft model (its weights, workspace and KV for as "
                   "many tokens)" if self.guest is not None else ""))
