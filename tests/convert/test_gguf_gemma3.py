"""GGUF files of the gemma3 architecture and SentencePiece vocabularies.

A small gemma3 GGUF is written here the way llama.cpp lays one out (Q8_0, Q5_0, Q4_K, Q6_K and F32
tensors, gemma3.* metadata, a SentencePiece vocabulary with scores). Tensors are checked against the
`gguf` package's dequantizer on the stored bytes; the tokenizer against a plain SentencePiece BPE
encoder written below (best-scoring adjacent pair first, user-defined pieces cut out whole, byte
fallback). The real Gemma 3 270M file is checked in tests/engine/test_families.py.
"""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open
from tokenizers import Tokenizer

from rawinfer.config import RopeConfig
from rawinfer.convert import ConversionError, convert

C, H, HKV, D, F, L, W = 256, 4, 1, 64, 256, 6, 32
SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# Normal pieces with distinct scores (SentencePiece merges the best-scoring pair; equal scores would
# leave the order to tie rules the test does not need).
PIECES = {SPACE: -1.0, "a": -2.0, "b": -2.1, "c": -2.2, "d": -2.3, "e": -2.4, "\u00e9": -2.5,
          "ab": -3.0, "bc": -3.1, "cd": -3.2, "abc": -3.3, SPACE + "a": -3.4, SPACE + "ab": -3.5,
          "de": -3.6, "cde": -3.7, SPACE + "abc": -3.8, "bcd": -3.9, "aa": -4.0, "aaa": -4.1,
          "e" + SPACE: -4.2, SPACE + SPACE: -4.3, "\u00e9a": -4.4}
USER = ["<tool>", "\n\n"]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma's id order: pad, eos, bos, unk, control, user-defined, the 256 bytes, normal pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"] + USER
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL] + [USER_DEFINED] * len(USER)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    scores = [0.0] * len(tokens) + list(PIECES.values())
    return tokens + list(PIECES), scores, types + [NORMAL] * len(PIECES)


def spm_encode(text: str, add_space_prefix: bool) -> list[int]:
    """SentencePiece BPE, the plain way; no BOS. With add_space_prefix every stretch of text between
    cut-out pieces starts with a SPACE (llama.cpp's rule)."""
    tokens, _, _ = spm_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    out: list[int] = []
    i, pending = 0, ""

    def flush() -> None:
        if not pending:
            return
        syms = list((SPACE if add_space_prefix else "") + pending.replace(" ", SPACE))
        while True:
            pairs = [(PIECES[a + b], -k) for k, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in PIECES]
            if not pairs:
                break
            k = -max(pairs)[1]                               # best score, leftmost on a tie
            syms[k:k + 2] = [syms[k] + syms[k + 1]]
        for s in syms:
            out.extend([ids[s]] if s in PIECES else [ids[f"<0x{b:02X}>"] for b in s.encode()])

    while i < len(text):
        match = max((u for u in USER if text.startswith(u, i)), key=len, default=None)
        if match is None:
            pending += text[i]
            i += 1
            continue
        flush()
        out.append(ids[match])
        pending, i = "", i + len(match)
    flush()
    return out


def _raw_k_quant(rows: int, cols: int, qtype: QT, rng) -> np.ndarray:
    """Random K-quant blocks with small, finite float16 scales (gguf-py cannot quantize these types)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == QT.Q4_K:          # d, dmin first
        raw[:, :, 0:4] = np.array([0.01, 0.005], np.float16).view(np.uint8)
    else:                         # Q6_K: d last
        raw[:, :, -2:] = np.array([0.002], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gemma3_gguf(path: str, *, softcap: bool = False, pattern=None, add_space_prefix: bool = False) -> dict:
    """A 6-layer gemma3 GGUF; returns {tensor name: float32 values as the file stores them}."""
    rng = np.random.default_rng(3)
    tokens, scores, types = spm_vocab()
    V = len(tokens)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(1024)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(W)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    if softcap:
        w.add_final_logit_softcapping(30.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    values = {}

    def add(name: str, shape: tuple[int, ...], qtype: QT) -> None:
        if qtype in (QT.Q4_K, QT.Q6_K):
            data = _raw_k_quant(*shape, qtype, rng)
        elif qtype == QT.F32:
            data = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype == QT.F32 else qtype)
        values[name] = data if qtype == QT.F32 else gguf.quants.dequantize(data, qtype).reshape(shape)

    add("token_embd.weight", (V, C), QT.Q8_0)
    add("output_norm.weight", (C,), QT.F32)
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_q.weight", (H * D, C), QT.Q5_0)
        add(b + "attn_k.weight", (HKV * D, C), QT.Q5_0)
        add(b + "attn_v.weight", (HKV * D, C), QT.Q8_0)
        add(b + "attn_output.weight", (C, H * D), QT.Q4_K)
        add(b + "ffn_gate.weight", (F, C), QT.Q5_0)
        add(b + "ffn_up.weight", (F, C), QT.Q5_0)
        add(b + "ffn_down.weight", (C, F), QT.Q6_K)
        for norm, n in (("attn_norm", C), ("attn_q_norm", D), ("attn_k_norm", D), ("post_attention_norm", C),
                        ("ffn_norm", C), ("post_ffw_norm", C)):
            add(f"{b}{norm}.weight", (n,), QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    values = write_gemma3_gguf(str(root / "g.gguf"))
    cfg = convert(str(root / "g.gguf"), str(root / "out"), progress=False)
    return str(root / "out"), cfg, values


def test_gemma3_metadata(gemma3_gguf):
    _, cfg, _ = gemma3_gguf
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("gemma3", L, H, HKV, D)
    assert (cfg.hidden_act, cfg.qk_norm, cfg.sandwich_norms, cfg.tie_word_embeddings) == ("gelu_tanh", True, True, True)
    assert cfg.embed_scale == pytest.approx(math.sqrt(C)) and cfg.scale == pytest.approx(D ** -0.5)
    # no pattern in the file: llama.cpp's default, every sixth layer global
    assert cfg.sliding_window == W and cfg.layer_types == ("sliding",) * 5 + ("full",)
    assert cfg.rope == RopeConfig(theta=1e6) and cfg.rope_local == RopeConfig(theta=1e4)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id, cfg.add_bos_token) == (2, (1, 4), 0, True)


def test_gemma3_tensors(gemma3_gguf):
    """Every type dequantized; q/k rows kept as stored (gemma3 is in rotate-half order already);
    norms as stored (GGUF holds 1 + w); Gemma's norm names mapped to rawinfer's four."""
    dst, _, v = gemma3_gguf
    with safe_open(os.path.join(dst, "model.safetensors"), framework="numpy") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert "lm_head" not in got
    np.testing.assert_array_equal(got["embed_tokens"], v["token_embd.weight"])
    np.testing.assert_array_equal(got["final_norm"], v["output_norm.weight"])
    for i in range(L):
        b, p = f"blk.{i}.", f"layers.{i}."
        want = {"qkv_proj": np.concatenate([v[b + f"attn_{x}.weight"] for x in "qkv"]),
                "o_proj": v[b + "attn_output.weight"],
                "gate_up_proj": np.concatenate([v[b + "ffn_gate.weight"], v[b + "ffn_up.weight"]]),
                "down_proj": v[b + "ffn_down.weight"],
                "input_norm": v[b + "attn_norm.weight"], "q_norm": v[b + "attn_q_norm.weight"],
                "k_norm": v[b + "attn_k_norm.weight"], "attn_out_norm": v[b + "post_attention_norm.weight"],
                "post_attn_norm": v[b + "ffn_norm.weight"], "mlp_out_norm": v[b + "post_ffw_norm.weight"]}
        for k, x in want.items():
            np.testing.assert_array_equal(got[p + k], x, err_msg=p + k)
    assert len(got) == 2 + 10 * L


def test_sliding_window_pattern_per_layer(tmp_path):
    flags = [True, False, True, True, False, False]
    write_gemma3_gguf(str(tmp_path / "g.gguf"), pattern=flags)
    cfg = convert(str(tmp_path / "g.gguf"), str(tmp_path / "out"), progress=False)
    assert cfg.layer_types == tuple("sliding" if f else "full" for f in flags)


@pytest.mark.parametrize("kwargs, words", [
    (dict(softcap=True), "final_logit_softcapping, a logit soft-cap"),
    (dict(pattern=[True, False]), "sliding-window flag for 2 layers but has 6"),
])
def test_bad_gemma3_gguf(tmp_path, kwargs, words):
    write_gemma3_gguf(str(tmp_path / "g.gguf"), **kwargs)
    with pytest.raises(ConversionError, match=words):
        convert(str(tmp_path / "g.gguf"), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


# ---- SentencePiece vocabulary --------------------------------------------------------------------

TEXTS = ["abc", "abcde", " abc abc", "aaaa", "ab\n\ncde", "<tool>abc", "x<tool> ab", "\u00e9a\u00fc", "  e  e ",
         "cd<end_of_turn>ab", "dé", ""]


def _random_texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    alphabet = ["a", "b", "c", "d", "e", " ", "\u00e9", "\u00fc", "\n", "<tool>", "\n\n", "\u732b"]
    return ["".join(rng.choice(alphabet, rng.integers(1, 14))) for _ in range(n)]


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_sentencepiece_tokenizer_matches_plain_bpe(tmp_path, add_space_prefix):
    write_gemma3_gguf(str(tmp_path / "g.gguf"), add_space_prefix=add_space_prefix)
    convert(str(tmp_path / "g.gguf"), str(tmp_path / "out"), progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    for text in TEXTS + _random_texts(300):
        if "<end_of_turn>" in text:          # a control token: matched whole, as a special token
            continue
        want = spm_encode(text, add_space_prefix)
        assert tok.encode(text).ids == [2] + want, repr(text)
        if not add_space_prefix or not any(u in text for u in USER):   # (prefixes after a cut-out piece stay)
            assert tok.decode(want) == text, repr(text)
    ids = tok.encode("cd<end_of_turn>ab").ids
    assert ids == [2] + spm_encode("cd", add_space_prefix) + [4] + spm_encode("ab", add_space_prefix)
    assert tok.decode(ids) == ("cd ab" if add_space_prefix else "cdab")      # special tokens skipped
