"""Request checks at admission: a prompt's token ids, and whether a request can ever fit the context and the pool.

Each refusal is a RequestRejected (a ValueError) naming the limit and the fix; the engine raises it before
anything of the request is queued.
"""

from __future__ import annotations

import numpy as np

from rawinfer.config import EngineConfig, is_int


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool, bad prompt, duplicate id)."""


def encode_prompt(tokenizer, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """The prompt's token ids: a string through the tokenizer, or a list of ids inside the vocabulary."""
    V = vocab_size
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejected("this model has no tokenizer: pass the prompt as a list of token ids")
        try:
            ids = tokenizer.encode(prompt)
        except ValueError as e:              # text that is not UTF-8
            raise RequestRejected(f"the prompt cannot be tokenized: {e}") from None
    elif isinstance(prompt, (list, tuple)) and all((is_int(t) or isinstance(t, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
    else:
        raise RequestRejected("a prompt must be a string or a list of integer token ids")
    if not ids:
        raise RequestRejected("the prompt is empty: give at least one token")
    return ids


def check_fits(num_tokens: int, n: int, what: str, *, max_model_len: int, ecfg: EngineConfig, kv_window: int,
               num_blocks: int) -> None:
    """RequestRejected unless n sequences of num_tokens tokens fit the context and the whole pool of num_blocks."""
    if num_tokens > max_model_len:
        raise RequestRejected(f"{what} = {num_tokens} exceeds the maximum context of {max_model_len} "
                              "tokens; shorten the prompt or lower max_tokens")
    bs, W = ecfg.block_size, kv_window
    need = -(-num_tokens // bs)
    if W:   # every layer slides: blocks behind the window go back, so a sequence holds at most the
        # window plus one chunk of new tokens (scheduler.update -> BlockManager.release_before)
        need = min(need, (W - 1 + min(num_tokens, ecfg.max_num_batched_tokens)) // bs + 2)
    need *= n
    if need > num_blocks:
        raise RequestRejected(
            f"the request needs up to {need} KV blocks ({num_tokens} tokens x {n} samples) but the whole "
            f"pool has {num_blocks}; raise --kv-cache-memory or lower max_tokens/n")
