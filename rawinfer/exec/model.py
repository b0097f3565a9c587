"""The Llama-family forward pass (Llama, Mistral, Qwen2) written against the backend op interface.

One call runs every layer over a flat batch of T tokens from B sequences (prefill chunks and decode
tokens mixed), writes their K/V into the paged cache, and returns logits for the rows that need them:

    ids[T] -> embedding -> residual[T, C] (float32)
    per layer:  x = rmsnorm(residual)              (fused with the residual add from layer 2 on)
                qkv = x @ Wqkv^T (+ b)             [T, (H+2Hkv)*D]
                rope(q, k); kv_write(k, v)         into k_cache/v_cache[NB, Hkv, BS, D]
                a = paged_attention(q, cache)      [T, H*D]
                h = a @ Wo^T                       [T, C]
                x = add_rmsnorm(h, residual)
                gu = x @ Wgate_up^T                [T, 2F]
                h = (silu(g) * u) @ Wdown^T        [T, C]
    final add_rmsnorm; rows at logits_indices -> lm_head -> logits[S, V]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rawinfer.backend.base import FlatBatch, LayerWeights
from rawinfer.config import ModelConfig
from rawinfer.exec.memory import MemoryPool
from rawinfer.quant import Int8Weight, quantized_weight


class LlamaModel:
    def __init__(self, cfg: ModelConfig, pool: MemoryPool):
        self.cfg, self.pool, self.backend = cfg, pool, pool.backend
        self.scale = 1.0 / float(np.sqrt(cfg.head_dim))
        w = pool.weights

        def weight(name):   # a float matrix, or an Int8Weight / Q4Weight for a quantized model's matrices
            return quantized_weight(w, name)

        self.layers = [LayerWeights(**{k: weight(f"layers.{i}.{k}") for k in LayerWeights.__dataclass_fields__})
                       for i in range(cfg.num_layers)]
        self.embed = weight("embed_tokens")
        self.lm_head = self.embed if cfg.tie_word_embeddings else weight("lm_head")
        self.acts = pool.workspace.acts
        self.scratch = pool.workspace.dequant if cfg.quant else None
        self.fused_max_tokens = self.backend.fused_max_tokens(cfg.quant)
        self.fused_plan = None            # built by weights_loaded()
        self.fused_decode_max = 0         # pure decode batches up to this many tokens take the fused path too
        self.final_norm = w["final_norm"]
        self.cos_sin = w["rope_cos_sin"]

    def weights_loaded(self) -> None:
        """Called once the pool holds the weights: the backend may repack int8 matrices for its GEMMs
        (Backend.prepare_int8); the pool's own int8 rows stay what the other ops read."""
        be = self.backend
        repack = (lambda w: be.prepare_int8(w) if isinstance(w, Int8Weight) else w)
        self.layers = [dataclasses.replace(L, **{k: repack(getattr(L, k)) for k in LayerWeights.MATRICES})
                       for L in self.layers]
        self.lm_head = repack(self.lm_head)
        if self.fused_max_tokens:
            self.fused_plan = be.fused_plan(self.layers, self.pool.kv.k, self.pool.kv.v)
            self.fused_max_tokens, self.fused_decode_max = be.fused_limits(self.fused_plan)

    def forward(self, batch: FlatBatch):
        """Run the layers; returns the logits view [S, V] (float32) of the pool's workspace."""
        self.forward_hidden(batch)
        return self.compute_logits(batch.logits_indices)

    def forward_hidden(self, batch: FlatBatch):
        """Every layer and the final norm; returns the normed hidden rows [T, C] (a workspace view)."""
        cfg, be, a = self.cfg, self.backend, self.acts
        T = batch.num_tokens
        if T > self.pool.max_tokens:
            raise ValueError(f"batch of {T} tokens exceeds the workspace ({self.pool.max_tokens} tokens)")
        eps = cfg.rms_norm_eps
        res, x = a.residual[:T], a.normed[:T]
        be.embedding(batch.token_ids, self.embed, res)   # the residual stream starts as the embeddings
        fused = T <= self.fused_max_tokens or (batch.max_query_len == 1 and T <= self.fused_decode_max)
        if fused and self.fused_plan is not None:         # decode batches: one call for all layers
            be.decoder_layers(self.fused_plan, a, T, batch, self.cos_sin, eps, self.scale, cfg.num_heads,
                              cfg.num_kv_heads)
        else:
            for i, L in enumerate(self.layers):
                self._layer(i, L, batch, T)
        be.add_rmsnorm(a.hidden[:T], res, self.final_norm, eps, x)
        return x

    def _layer(self, i: int, L: LayerWeights, batch: FlatBatch, T: int) -> None:
        """One decoder layer, op by op, over the activation rows [:T]."""
        cfg, be, a, kv = self.cfg, self.backend, self.acts, self.pool.kv
        eps = cfg.rms_norm_eps
        h, res, x = a.hidden[:T], a.residual[:T], a.normed[:T]
        qkv, attn, gu, act = a.qkv[:T], a.attn[:T], a.gate_up[:T], a.act[:T]
        if i == 0:
            be.rmsnorm(res, L.input_norm, eps, x)
        else:
            be.add_rmsnorm(h, res, L.input_norm, eps, x)
        be.linear(x, L.qkv_proj, qkv, bias=L.qkv_bias, scratch=self.scratch)
        be.rope(qkv, batch.positions, self.cos_sin, cfg.num_heads, cfg.num_kv_heads)
        be.kv_write(qkv, kv.k[i], kv.v[i], batch.slot_mapping, cfg.num_heads)
        be.paged_attention(qkv, kv.k[i], kv.v[i], batch.block_tables, batch.context_lens,
                           batch.query_start_loc, self.scale, attn, batch.max_query_len, batch.max_context_len)
        be.linear(attn, L.o_proj, h, scratch=self.scratch)
        be.add_rmsnorm(h, res, L.post_attn_norm, eps, x)
        be.linear_silu_mul(x, L.gate_up_proj, gu, act, scratch=self.scratch)
        be.linear(act, L.down_proj, h, scratch=self.scratch)

    def compute_logits(self, indices):
        """LM head over rows `indices` [S] of the last forward_hidden -> logits view [S, V] float32."""
        S = indices.shape[0]
        if S > self.pool.logits_rows:
            raise ValueError(f"{S} logits rows exceed the workspace ({self.pool.logits_rows})")
        ws = self.pool.workspace
        last, logits = ws.last[:S], ws.logits[:S]
        if S == 0:
            return logits
        self.backend.take_rows(self.acts.normed, indices, last)
        self.backend.linear(last, self.lm_head, logits, scratch=self.scratch)
        return logits
