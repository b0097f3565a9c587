"""Numba kernels of the ops some model families add to the Llama layer (config.py's v2 keys):

    head_rmsnorm_kernel    RMSNorm over every q and k head of the QKV rows, before RoPE (qk_norm:
                           Qwen3, Gemma 3)
    gelu_tanh_mul_kernel   GeGLU with the tanh-approximated GELU (hidden_act "gelu_tanh": Gemma 3)

Each has a NumPy `<op>_ref` twin in tests/reference_ops.py. Like kernels.py, statistics and math are
float32 and row sums run in one fixed order (kernels.sum_squares), so the serial and parallel builds
give the same bits.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawinfer.backend.cpu.kernels import Kernel, fast_exp, sum_squares

# gelu_tanh(g) = 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3); since 0.5 (1 + tanh(z)) is
# sigmoid(2z), it is g / (1 + exp(-2z)): one exp, the form silu_mul already vectorizes.
_TWO_SQRT_2_OVER_PI = np.float32(2.0 * np.sqrt(2.0 / np.pi))
_GELU_CUBIC = np.float32(0.044715)


def _head_rmsnorm_kernel(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads):
    # qkv[T, (H + 2Hkv) * D] in place: q heads 0..H-1 with q_weight[D], k heads H..H+Hkv-1 with k_weight[D]
    T = qkv.shape[0]
    D = q_weight.shape[0]
    for t in nb.prange(T):
        for h in range(num_heads + num_kv_heads):
            x = qkv[t, h * D:(h + 1) * D]
            w = q_weight if h < num_heads else k_weight
            inv = np.float32(1.0) / np.sqrt(sum_squares(x) / np.float32(D) + eps)
            for d in range(D):
                x[d] = x[d] * inv * w[d]


def _gelu_tanh_mul_kernel(gate_up, out):
    # out[T, F] = gelu_tanh(gate_up[:, :F]) * gate_up[:, F:]
    T, F = out.shape
    for t in nb.prange(T):
        for f in range(F):
            g = gate_up[t, f]
            z = _TWO_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)
            out[t, f] = g / (np.float32(1.0) + fast_exp(-z)) * gate_up[t, F + f]


head_rmsnorm_kernel = Kernel(_head_rmsnorm_kernel)
gelu_tanh_mul_kernel = Kernel(_gelu_tanh_mul_kernel, fastmath={"contract"})
