"""KV transfer between two engines (prefill/decode disaggregation): a prompt's K/V exported from the blocks
of the engine that computed it, as raw bytes per layer, and written into blocks another engine reserved.

    prefill engine                                   decode engine
    add_export(id, prompt, start_block)              reserve(id) -> Reservation (blocks start_block..)
      runs prompt[:P-1] (its own prefix cache)
      after_step: layers [2, n, Hkv, R, D] -> host
      the request ends, its blocks go back at once
    take_ready() -> KVExport  ---- bytes ---->      write(id, layer, bytes) x L; complete(id)
                                                     the sequence runs with P - 1 tokens computed and
                                                     computes its last prompt token itself

Only the blocks the decode engine does not already hold (from start_block on) are computed into bytes.
The decode engine samples from its own logits of the last prompt token, so seeds, log-probabilities and
stop rules are exactly those of a colocated run. Both sides compare a Fingerprint first: the same weights,
layer count, KV heads, head dim, block size and KV storage type, or the bytes mean nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

import numpy as np

from rawinfer.core.scheduler import Reservation, SchedulerOutput
from rawinfer.core.sequence import Sequence
from rawinfer.sampling import SamplingParams

WEIGHT_SAMPLE = 4096        # leading and trailing elements of every weight tensor that the digest covers


@dataclass(frozen=True)
class Fingerprint:
    """What two engines must share for one's K/V bytes to be valid in the other's blocks."""

    weights: str            # sha256 over every weight tensor's name, shape, dtype and a sample of its values
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str           # the cache's storage type
    kv_rows: int            # rows of one (block, KV head) tile: BS, plus the scale rows of an int8 cache
    int8_activations: bool  # K/V computed on 8-bit activations (valid bytes, other numbers than without)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> "Fingerprint":
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict) or sorted(d) != sorted(names):
            raise ValueError(f"a model fingerprint needs exactly the fields {', '.join(names)}")
        return cls(**d)

    def mismatch(self, other: "Fingerprint") -> str | None:
        """One sentence naming every differing field with both values, or None when they agree."""
        diffs = [f"{f.name} {getattr(self, f.name)!r} here vs {getattr(other, f.name)!r} there"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if not diffs:
            return None
        return ("the prefill and decode instances serve different models or KV layouts (" + "; ".join(diffs) +
                "); start both with the same model, --block-size, --kv-cache-dtype and --int8-activations")


def fingerprint(engine) -> Fingerprint:
    cfg, pool = engine.model_config, engine.pool
    h = hashlib.sha256()
    for name in sorted(pool.weights):
        w = pool.weights[name]
        flat = w.reshape(-1)
        h.update(f"{name}{tuple(w.shape)}{w.dtype}".encode())
        for part in (flat[:WEIGHT_SAMPLE], flat[-WEIGHT_SAMPLE:]):
            h.update(np.ascontiguousarray(engine.backend.to_host(part)).tobytes())
    k = pool.kv.k[0]
    return Fingerprint(h.hexdigest()[:32], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pool.kv.block_size,
                       str(k.dtype), int(k.shape[2]), bool(engine.config.int8_activations))


@dataclass
class KVExport:
    """The K/V of one prompt's blocks start_block .. start_block + num_blocks - 1, ready to send."""

    request_id: str
    start_block: int
    num_tokens: int                 # prompt tokens whose K/V the blocks hold (all but the last)
    layers: list[np.ndarray]        # L x [2, n, Hkv, R, D] host arrays in the cache's storage dtype

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[1]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)


@dataclass
class _Receiving:
    seq: Sequence
    reservation: Reservation
    layers: set[int]


class KVTransfer:
    """One engine's side of transfers: exports it computes (prefill role) and reservations it fills (decode
    role). Called from the engine's own thread only, between steps; it calls the engine's public methods and
    the scheduler's remote-prefill hooks only."""

    def __init__(self, engine):
        self.engine = engine
        self._fingerprint: Fingerprint | None = None
        self.clear()

    def clear(self) -> None:
        """Forget every export and reservation (for an engine starting over: their blocks went with its block
        manager)."""
        self._exports: dict[str, int] = {}          # request id -> start block, prompt not yet computed
        self._ready: list[KVExport] = []
        self._receiving: dict[str, _Receiving] = {}

    @property
    def fingerprint(self) -> Fingerprint:
        if self._fingerprint is None:                # the weights are loaded after the engine's setup
            self._fingerprint = fingerprint(self.engine)
        return self._fingerprint

    def block_bytes(self, num_blocks: int) -> int:
        """Bytes num_blocks blocks take on the wire (every layer's K and V)."""
        k = self.engine.pool.kv.k[0]
        return 2 * len(self.engine.pool.kv.k) * num_blocks * int(np.prod(k.shape[1:])) * k.dtype.itemsize

    # ---- prefill role --------------------------------------------------------------------------
    def add_export(self, request_id: str, prompt_ids: list[int], start_block: int) -> None:
        """Compute prompt_ids[:-1] and export its blocks from start_block on (RequestRejected, a ValueError,
        when the request cannot run here)."""
        bs = self.engine.config.block_size
        if not isinstance(start_block, int) or start_block < 0 or start_block * bs >= len(prompt_ids) - 1:
            raise ValueError(f"start block {start_block!r} leaves no K/V to send for a prompt of {len(prompt_ids)} "
                             f"tokens (block size {bs}); prefill it on the decode instance")
        if self.engine.model_config.kv_window:
            raise ValueError("a sliding-window model gives blocks back while it prefills; prefill it locally")
        self.engine.add_request(request_id, list(prompt_ids[:-1]), SamplingParams(max_tokens=0))
        self._exports[request_id] = start_block

    def after_step(self, out: SchedulerOutput) -> None:
        """After a forward pass and before scheduler.update: copy out the blocks of every export whose prompt is
        now computed (the update ends its request, giving its blocks back)."""
        if not self._exports:
            return
        for s in out.seqs:
            start = self._exports.get(s.seq.request_id)
            if start is None or not s.samples:
                continue
            del self._exports[s.seq.request_id]
            ids = self.engine.block_manager.block_table(s.seq.seq_id)[start:]
            layers = self.engine.backend.kv_blocks_to_host(self.engine.pool.kv, ids)
            self._ready.append(KVExport(s.seq.request_id, start, s.seq.num_prompt_tokens, layers))

    def take_ready(self) -> list[KVExport]:
        ready, self._ready = self._ready, []
        return ready

    def abort_export(self, request_id: str) -> None:
        self._exports.pop(request_id, None)
        self._ready = [e for e in self._ready if e.request_id != request_id]
        self.engine.abort(request_id)

    # ---- decode role ---------------------------------------------------------------------------
    def reserve(self, request_id: str, min_tokens: int = 1) -> Reservation | None:
        """Blocks for a queued request's prompt K/V to arrive into, if it may prefill remotely (one waiting
        sample that wants no prompt log-probabilities, Scheduler.can_reserve_remote) and at least min_tokens
        of them are not in this engine's prefix cache (None: it prefills here as usual)."""
        seqs = self.engine.sequences(request_id)
        if len(seqs) != 1 or not self.engine.scheduler.can_reserve_remote(seqs[0]):
            return None
        r = self.engine.scheduler.reserve_remote(seqs[0], min_tokens)
        if r is not None:
            self._receiving[request_id] = _Receiving(seqs[0], r, set())
        return r

    def is_receiving(self, request_id: str) -> bool:
        self._forget_finished()
        return request_id in self._receiving

    def write(self, request_id: str, layer: int, data) -> None:
        """Store one layer's bytes (KVExport.layers[layer]'s) into the request's reserved blocks. ValueError
        for an unknown request, a layer out of range or bytes of the wrong size: nothing is written then."""
        rec = self._get(request_id)
        kv = self.engine.pool.kv
        if not isinstance(layer, int) or not 0 <= layer < len(kv.k):
            raise ValueError(f"layer {layer!r} is outside the model's {len(kv.k)} layers")
        n = len(rec.reservation.block_ids)
        k = kv.k[layer]
        buf = np.frombuffer(data, dtype=np.uint8)
        if buf.nbytes != self.block_bytes(n) // len(kv.k):
            raise ValueError(f"layer {layer} of request {request_id!r} has {buf.nbytes} bytes of K/V, expected "
                             f"{self.block_bytes(n) // len(kv.k)} ({n} blocks)")
        kv.write_blocks(self.engine.backend.xp, layer, rec.reservation.block_ids,
                        buf.view(k.dtype).reshape((2, n) + tuple(k.shape[1:])))
        rec.layers.add(layer)

    def complete(self, request_id: str) -> None:
        """Every layer arrived: the request runs (its blocks become readable and enter the prefix cache)."""
        rec = self._get(request_id)
        missing = sorted(set(range(len(self.engine.pool.kv.k))) - rec.layers)
        if missing:
            raise ValueError(f"request {request_id!r} still lacks the K/V of layer(s) {missing}")
        del self._receiving[request_id]
        self.engine.scheduler.complete_remote(rec.seq)

    def cancel(self, request_id: str) -> bool:
        """Give the reserved blocks back; the request prefills here instead. False if it was not receiving."""
        self._forget_finished()
        rec = self._receiving.pop(request_id, None)
        if rec is not None:
            self.engine.scheduler.cancel_remote(rec.seq)
        return rec is not None

    def _get(self, request_id: str) -> _Receiving:
        self._forget_finished()
        rec = self._receiving.get(request_id)
        if rec is None:
            raise ValueError(f"request {request_id!r} is not waiting for K/V (aborted, finished or never reserved)")
        return rec

    def _forget_finished(self) -> None:
        """Drop the records of requests aborted while receiving (the scheduler freed their blocks)."""
        gone = [rid for rid, rec in self._receiving.items() if rec.seq.is_finished]
        for rid in gone:
            del self._receiving[rid]
