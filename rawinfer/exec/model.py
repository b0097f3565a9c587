"""The decoder forward pass, written against the backend op interface, for every family the config
describes (Llama, Mistral, Qwen2, Qwen3, Gemma 3): a family is a set of ModelConfig keys, not a copy of
this file.

One call runs every layer over a flat batch of T tokens from B sequences (prefill chunks and decode
tokens mixed), writes their K/V into the paged cache, and returns logits for the rows that need them:

    ids[T] -> embedding (* embed_scale) -> residual[T, C] (float32)
    per layer:  x = rmsnorm(residual)              (fused with the residual add from layer 2 on)
                qkv = x @ Wqkv^T (+ b)             [T, (H+2Hkv)*D]
                head_rmsnorm(q, k)                 (qk_norm: Qwen3, Gemma 3)      |  one op:
                rope(q, k) with the layer's table                                 |  fused_rope_kv_write
                kv_write(k, v) into k_cache/v_cache[NB, Hkv, BS, D]               |
                a = paged_attention(q, cache)      [T, H*D], the layer's sliding window if it has one
                h = a @ Wo^T                       [T, C]
                h = rmsnorm(h)                     (sandwich_norms: Gemma 3)      |  one op with sandwich
                x = add_rmsnorm(h, residual)                                      |  norms: norm_add_rmsnorm
                gu = x @ Wgate_up^T                [T, 2F]
                h = (act(g) * u) @ Wdown^T         [T, C]  act: silu (SwiGLU) or gelu_tanh (GeGLU)
                h = rmsnorm(h)                     (sandwich_norms: joined to the next residual add)
    final add_rmsnorm; rows at logits_indices -> lm_head -> logits[S, V]

The fused ops' defaults in backend/base.py are the separate ops in this order, so a backend without
its own fused kernels runs exactly the op sequence above.
"""

from __future__ import annotations

import dataclasses

from rawinfer.backend.base import FlatBatch, LayerWeights
from rawinfer.config import ModelConfig
from rawinfer.exec.memory import MemoryPool
from rawinfer.quant import Fp8Weight, Int8Weight, Q4Weight, quantized_weight


class DecoderModel:
    def __init__(self, cfg: ModelConfig, pool: MemoryPool):
        self.cfg, self.pool, self.backend = cfg, pool, pool.backend
        self.scale = cfg.scale
        w = pool.weights

        def weight(name):   # a float matrix, or an Int8Weight / Q4Weight / Fp8Weight for a quantized model's
            return quantized_weight(w, name)

        self.cos_sin = w["rope_cos_sin"]
        self.layers = []
        for i in range(cfg.num_layers):
            tensors = {k: weight(f"layers.{i}.{k}") for k in LayerWeights.TENSORS if f"layers.{i}.{k}" in w}
            local = cfg.rope_local is not None and cfg.layer_window(i)
            self.layers.append(LayerWeights(**{"qkv_bias": None, **tensors}, window=cfg.layer_window(i),
                                            cos_sin=w["rope_cos_sin_local"] if local else self.cos_sin))
        self.embed = weight("embed_tokens")
        self.lm_head = self.embed if cfg.tie_word_embeddings else weight("lm_head")
        self.acts = pool.workspace.acts
        self.scratch = pool.workspace.dequant if cfg.quant else None
        # the fused decode path (Backend.decoder_layers; its plan says which batches it takes)
        self.fused_max_tokens = self.backend.fused_max_tokens(cfg.quant)
        self.fused_plan = None            # built by weights_loaded()
        self.fused_decode_max = 0         # pure decode batches up to this many tokens take the fused path too
        self.final_norm = w["final_norm"]

    def weights_loaded(self) -> None:
        """Called once the pool holds the weights: the backend may repack the int8 and q4 matrices for its
        GEMMs (Backend.prepare_weight); the pool's own copies stay what the other ops read. fp8 matrices,
        the embedding table too, are what prepare_weight makes of them (the CPU: float32 copies)."""
        be = self.backend
        quantized = (Int8Weight, Q4Weight, Fp8Weight)
        repack = (lambda w, head=False: be.prepare_weight(w, head) if isinstance(w, quantized) else w)
        self.layers = [dataclasses.replace(L, **{k: repack(getattr(L, k)) for k in LayerWeights.MATRICES})
                       for L in self.layers]
        tied = self.lm_head is self.embed
        self.lm_head = repack(self.lm_head, head=True)
        if isinstance(self.embed, Fp8Weight):     # no embedding op takes fp8 codes; a tied table is prepared once
            self.embed = self.lm_head if tied else be.prepare_weight(self.embed)
        if self.fused_max_tokens:
            self.fused_plan = be.fused_plan(self.layers, self.pool.kv.k, self.pool.kv.v,
                                            gelu=self.cfg.hidden_act == "gelu_tanh")
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
        be.embedding(batch.token_ids, self.embed, res, cfg.embed_scale)   # the residual stream starts here
        fused = T <= self.fused_max_tokens or (batch.max_query_len == 1 and T <= self.fused_decode_max)
        if fused and self.fused_plan is not None:         # decode batches: one call for all layers
            be.decoder_layers(self.fused_plan, a, T, batch, self.cos_sin, eps, self.scale, cfg.num_heads,
                              cfg.num_kv_heads)
            be.add_rmsnorm(a.hidden[:T], res, self.final_norm, eps, x)   # decoder_layers applied every norm
        else:
            out_norm = None          # the previous layer's MLP output norm (sandwich_norms), not yet applied
            for i, L in enumerate(self.layers):
                out_norm = self._layer(i, L, batch, T, out_norm)
            self._add_norm(a.hidden[:T], out_norm, res, self.final_norm, x)
        return x

    def _add_norm(self, h, h_norm, res, weight, out) -> None:
        """res += h (normalised with h_norm first, where the family has sandwich norms); out = rmsnorm(res)."""
        eps = self.cfg.rms_norm_eps
        if h_norm is None:
            self.backend.add_rmsnorm(h, res, weight, eps, out)
        else:
            self.backend.norm_add_rmsnorm(h, h_norm, res, weight, eps, out)

    def _layer(self, i: int, L: LayerWeights, batch: FlatBatch, T: int, h_norm=None):
        """One decoder layer, op by op, over the activation rows [:T]; h_norm: the previous layer's MLP
        output norm, applied here with the residual add. Returns this layer's (None without sandwich norms)."""
        cfg, be, a, kv = self.cfg, self.backend, self.acts, self.pool.kv
        eps = cfg.rms_norm_eps
        h, res, x = a.hidden[:T], a.residual[:T], a.normed[:T]
        qkv, attn, gu, act = a.qkv[:T], a.attn[:T], a.gate_up[:T], a.act[:T]
        if i == 0:
            be.rmsnorm(res, L.input_norm, eps, x)
        else:
            self._add_norm(h, h_norm, res, L.input_norm, x)
        be.linear(x, L.qkv_proj, qkv, bias=L.qkv_bias, scratch=self.scratch)
        be.fused_rope_kv_write(qkv, batch.positions, L.cos_sin, kv.k[i], kv.v[i], batch.slot_mapping, cfg.num_heads,
                               cfg.num_kv_heads, L.q_norm, L.k_norm, eps)
        be.paged_attention(qkv, kv.k[i], kv.v[i], batch.block_tables, batch.context_lens,
                           batch.query_start_loc, self.scale, attn, batch.max_query_len, batch.max_context_len,
                           L.window)
        be.linear(attn, L.o_proj, h, scratch=self.scratch)
        self._add_norm(h, L.attn_out_norm, res, L.post_attn_norm, x)
        if cfg.hidden_act == "gelu_tanh":
            be.linear(x, L.gate_up_proj, gu, scratch=self.scratch)
            be.gelu_tanh_mul(gu, act)
        else:
            be.linear_silu_mul(x, L.gate_up_proj, gu, act, scratch=self.scratch)
        be.linear(act, L.down_proj, h, scratch=self.scratch)
        return L.mlp_out_norm

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
