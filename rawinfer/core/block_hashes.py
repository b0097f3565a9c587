"""Prefix-cache digests of full KV blocks (core/block_manager.py explains the chain):

    h0 = sha256(ROOT_HASH || int32le(tokens[0:BS]))
    h1 = sha256(h0        || int32le(tokens[BS:2BS]))   ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH: bytes = hashlib.sha256(b"rawinfer prefix-cache root").digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest of one full block: sha256 over the parent's digest and the token ids as little-endian int32."""
    # NOTE: fixed-width int32 bytes keep the encoding unambiguous; out-of-range ids raise OverflowError.
    return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype="<i4").tobytes()).digest()


class BlockHashes:
    """The prefix-cache digests of one token sequence's full blocks, each computed once.

    Block i's digest chains over block i-1's and a sequence only ever appends tokens, so the digests of
    its full blocks never change: a sequence keeps one BlockHashes (Sequence.block_hashes) from its first
    prefix-cache lookup through every block registration, preemption included."""

    __slots__ = ("digests",)

    def __init__(self, digests: Sequence[bytes] = ()):
        self.digests: list[bytes] = list(digests)

    def upto(self, token_ids: Sequence[int], num_blocks: int, block_size: int) -> list[bytes]:
        """The digest list, extended to at least num_blocks full blocks of token_ids."""
        d = self.digests
        parent = d[-1] if d else ROOT_HASH
        for i in range(len(d), num_blocks):
            parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
            d.append(parent)
        return d
