"""NullBackend: the op interface with ops that return at once, so that timing the engine over it leaves the
engine's own host work per step (scheduling, the plan, sampling bookkeeping, outputs) and nothing else.

For benchmarks only (`rawinfer bench step-overhead`, frontends/bench/step_overhead.py); no device option
selects it. The engine runs over it unchanged: the memory pool is carved out of a NumPy arena as on the
CPU, but nothing is ever written into it. Uploads and layer ops leave their destinations as they were
(the arena's zeros), and argmax, the one op whose result the engine reads on the host during a plain
greedy step, answers `token_id` for every row without reading the logits. A real backend's own host
work per op (argument checks, kernel launches) is left out too: it is what decode graphs remove.
"""

from __future__ import annotations

import numpy as np

from rawinfer.backend.base import Backend, Capabilities


class NullBackend(Backend):
    name = "null"
    xp = np
    # every weight format loads, so any converted model's engine can be built over it
    capabilities = Capabilities(quantized_weights=("int8", "q4"))

    def __init__(self, token_id: int = 0):
        """token_id: the token argmax answers for every row (greedy steps pick it)."""
        self.token_id = int(token_id)
        self.op_calls = 0           # layer ops called so far: the engine did run its forward passes

    # ---- memory: a NumPy arena that stays as allocated ----------------------------------------
    def alloc_arena(self, nbytes: int):
        # NOTE: np.zeros maps zero pages lazily; an arena nothing writes costs no memory
        return np.zeros(nbytes, np.uint8)

    def upload(self, dst, src) -> None:
        pass

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    # ---- layer ops: nothing computed --------------------------------------------------------------
    def _op(self, *args, **kwargs) -> None:
        self.op_calls += 1

    embedding = rmsnorm = add_rmsnorm = norm_add_rmsnorm = linear = linear_silu_mul = _op
    rope = head_rmsnorm = gelu_tanh_mul = silu_mul = kv_write = fused_rope_kv_write = _op
    paged_attention = paged_attention_decode = paged_attention_prefill = _op
    copy_blocks = take_rows = _op

    def argmax(self, logits) -> np.ndarray:
        return np.full(int(logits.shape[0]), self.token_id, np.int64)
