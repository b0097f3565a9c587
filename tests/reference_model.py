"""A plain NumPy forward pass over a converted model folder: the converter's independent check.

It reads config.json and model.safetensors (safetensors' NumPy API, float models only) and computes
logits the slow, obvious way, in float64 by default: every token attends to the whole prefix through
an explicit [T, T] mask, nothing is cached, nothing is fused beyond what the format itself fuses. It
shares no code with rawinfer's engine, so agreement with transformers' logits says the converter wrote
the right numbers under the right names, and says what the config keys mean.

One decoder layer, with the optional parts of ModelConfig in brackets:

    x = embed_tokens[ids] * embed_scale
    h = rms(x) * input_norm
    q, k, v = split(h @ qkv_proj.T [+ qkv_bias])            q [T, H, D], k and v [T, Hkv, D]
    [q = rms_D(q) * q_norm;  k = rms_D(k) * k_norm]          qk_norm: per head, before RoPE
    q, k = rope(q), rope(k)                                  the layer's RoPE (rope, or rope_local)
    a = softmax(q k^T * scale + mask) v                      mask: causal [and the layer's window]
    o = a @ o_proj.T   [o = rms(o) * attn_out_norm]          sandwich_norms
    x = x + o
    h = rms(x) * post_attn_norm
    g, u = split(h @ gate_up_proj.T)
    m = (act(g) * u) @ down_proj.T   [m = rms(m) * mlp_out_norm]
    x = x + m
    logits = (rms(x) * final_norm) @ (lm_head or embed_tokens).T

RoPE is the rotate-half form: the first D/2 columns of a head pair with the last D/2.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy so bfloat16 folders load)
import numpy as np
from safetensors import safe_open

from rawinfer.config import ModelConfig, RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] float64 rotary frequencies, llama3 scaling applied band by band when the config asks."""
    base = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope.type == "default":
        return base
    assert rope.type == "llama3", rope.type
    old = rope.original_max_position_embeddings
    out = np.empty_like(base)
    for j, f in enumerate(base):
        wavelen = 2 * math.pi / f
        if wavelen < old / rope.high_freq_factor:          # high frequencies: untouched
            out[j] = f
        elif wavelen > old / rope.low_freq_factor:         # low frequencies: divided by factor
            out[j] = f / rope.factor
        else:                                              # in between: interpolated
            smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
            out[j] = (1 - smooth) * f / rope.factor + smooth * f
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * w over the last axis (w is the stored multiplier: Gemma's 1 + w already added)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def activation(name: str, g: np.ndarray) -> np.ndarray:
    if name == "silu":
        return g / (1 + np.exp(-g))
    assert name == "gelu_tanh", name
    return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def attention_mask(T: int, window: int) -> np.ndarray:
    """[T, T] additive mask: query t sees key s when s <= t and, with a window W, t - s < W."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    seen = (s <= t) & ((t - s < window) if window else True)
    return np.where(seen, 0.0, -np.inf)


class ReferenceModel:
    """A converted float model held as NumPy arrays; logits(ids) is one full forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype=np.float64):
        if cfg.quant is not None:
            raise ValueError(f"the reference reads float models only, not quant={cfg.quant}")
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.w = {name: np.asarray(x).astype(self.dtype) for name, x in weights.items()}

    @classmethod
    def from_dir(cls, folder: str, dtype=np.float64) -> "ReferenceModel":
        with open(os.path.join(folder, "config.json")) as f:
            cfg = ModelConfig.from_json(json.load(f))
        with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
            weights = {name: f.get_tensor(name) for name in f.keys()}
        return cls(cfg, weights, dtype)

    def _rope(self, x: np.ndarray, layer: int) -> np.ndarray:
        """x [T, heads, D] rotated by position (0..T-1) with layer's RoPE."""
        D = self.cfg.head_dim
        angle = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv_freq(self.cfg.layer_rope(layer), D)
        cos = np.cos(angle)[:, None, :].astype(self.dtype)                  # [T, 1, D/2]
        sin = np.sin(angle)[:, None, :].astype(self.dtype)
        a, b = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def _attention(self, h: np.ndarray, i: int) -> np.ndarray:
        cfg, w, p = self.cfg, self.w, f"layers.{i}."
        T, H, Hkv, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = h @ w[p + "qkv_proj"].T
        if cfg.qkv_bias:
            qkv = qkv + w[p + "qkv_bias"]
        q = qkv[:, :H * D].reshape(T, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        q, k = self._rope(q, i), self._rope(k, i)
        k = np.repeat(k, H // Hkv, axis=1)                                  # query head j reads kv head j // (H/Hkv)
        v = np.repeat(v, H // Hkv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) * cfg.scale + attention_mask(T, cfg.layer_window(i))
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.einsum("hts,shd->thd", probs, v).reshape(T, H * D) @ w[p + "o_proj"].T
        if cfg.sandwich_norms:
            out = rms_norm(out, w[p + "attn_out_norm"], cfg.rms_norm_eps)
        return out

    def _mlp(self, h: np.ndarray, i: int) -> np.ndarray:
        cfg, w, p = self.cfg, self.w, f"layers.{i}."
        g, u = np.split(h @ w[p + "gate_up_proj"].T, 2, axis=1)
        out = (activation(cfg.hidden_act, g) * u) @ w[p + "down_proj"].T
        if cfg.sandwich_norms:
            out = rms_norm(out, w[p + "mlp_out_norm"], cfg.rms_norm_eps)
        return out

    def hidden(self, ids) -> np.ndarray:
        """[T, C] final hidden states (after the final norm) of the token sequence ids."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        x = w["embed_tokens"][np.asarray(ids)] * self.dtype.type(cfg.embed_scale)
        for i in range(cfg.num_layers):
            x = x + self._attention(rms_norm(x, w[f"layers.{i}.input_norm"], eps), i)
            x = x + self._mlp(rms_norm(x, w[f"layers.{i}.post_attn_norm"], eps), i)
        return rms_norm(x, w["final_norm"], eps)

    def logits(self, ids, rows=None) -> np.ndarray:
        """[len(rows), V] logits at positions `rows` of ids (default: every position)."""
        x = self.hidden(ids)
        if rows is not None:
            x = x[np.asarray(rows)]
        head = self.w["embed_tokens"] if self.cfg.tie_word_embeddings else self.w["lm_head"]
        return x @ head.T

    def greedy(self, prompt_ids, steps: int) -> list[int]:
        """Greedy continuation of prompt_ids: one full forward pass per new token, no end-of-sequence stop."""
        ids = [int(t) for t in prompt_ids]
        out = []
        for _ in range(steps):
            nxt = int(np.argmax(self.logits(ids, rows=[len(ids) - 1])[0]))
            out.append(nxt)
            ids.append(nxt)
        return out
