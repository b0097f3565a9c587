"""Paged KV block manager: block tables, reference counts, the prefix cache and copy-on-write.

The KV pool is NB blocks of BS token slots (k_cache[NB, Hkv, BS, D], rawinfer/backend/base.py). Each
sequence owns a block table: logical block i (positions i*BS .. i*BS+BS-1) -> a physical block id.

Prefix cache. A FULL, computed block is registered under a digest chained over its parent's digest and
its own token ids, so equal digests mean equal whole prefixes:

    h0 = sha256(ROOT_HASH || int32le(tokens[0:BS]))
    h1 = sha256(h0        || int32le(tokens[BS:2BS]))   ...

sha256 makes a collision practically impossible, so a hit is trusted without comparing tokens. A full
block whose digest another physical block already holds (the same prefix computed side by side) stays
unregistered: no dedupe, because the runner may already hold the block table for this step.

Free list. A block whose reference count drops to 0 keeps its digest and goes to the tail of an LRU
FreeBlockQueue; a later prefix hit takes it back out of the middle in O(1). New data takes the head block,
dropping its digest (eviction). Blocks without a digest are freed to the head, reused before any cached
one. A sequence is released tail first, so a chain's tail is evicted before its prefix (worth more).

Token counts. The block manager keeps block tables, not token counts: how many of a sequence's tokens
are in the cache is the sequence's own num_computed_tokens (core/sequence.py), which every call that
depends on it passes in. A table covers ceil((computed + new) / BS) blocks once allocate_slots returns;
truncate gives back the tail blocks of tokens written but then rejected (speculative decoding).

Copy-on-write. fork() shares every block of the parent (ref++). A sequence's next tokens are written
from position num_computed_tokens; if that position falls inside a partially filled block with ref > 1,
allocate_slots swaps in a fresh block and reports (src, dst) for the model runner to copy in every layer
before the forward pass.

Sliding window. In a model whose every layer attends through a window of W tokens, a query at position
p reads positions p - W + 1 .. p only, and later queries read less far back. release_before(seq_id, pos)
gives back the sequence's blocks that hold only positions before pos while it runs (vLLM's
sliding-window manager does the same), so a long generation holds about W / BS blocks, not length / BS.
Their entries become DROPPED (id 0, never read: attention starts at the window); logical block i stays entry i.

NOTE: fork only after the step that computed the parent's tokens has run; pass cached_block_ids to
allocate_slots straight from find_cached_prefix (find takes no references: an allocation in between may
evict them, and allocate_slots then raises ValueError rather than hand out overwritten blocks).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from rawinfer.core.block_hashes import BlockHashes
from rawinfer.core.free_list import FreeBlockQueue, KVBlock

DROPPED = KVBlock(0)     # the table entry of a block a sliding-window sequence gave back (never read)


@dataclass(frozen=True)
class Allocation:
    """What one allocate_slots call changed in a sequence's block table."""

    new_block_ids: tuple[int, ...]      # appended to the table this call (prefix hits first, then fresh blocks)
    copies: tuple[tuple[int, int], ...]   # (src, dst) copy-on-write block copies to run before the forward pass


NOTHING_ALLOCATED = Allocation((), ())   # what a call that found the table already long enough changed (shared)


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens where it matters: hit rate = hit tokens / queried tokens."""

    queries: int = 0            # find_cached_prefix calls
    query_tokens: int = 0       # tokens looked up
    hit_tokens: int = 0         # tokens found cached (whole blocks)
    evicted_blocks: int = 0     # cached blocks reused for new data
    cached_free_blocks: int = 0     # gauge: free blocks that still hold a cached prefix (a hit takes them back)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class _SeqBlocks:
    """One sequence's block table and how many of its leading blocks went through cache_full_blocks."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_dropped: int = 0        # leading entries given back by release_before (DROPPED)
    ids: tuple[int, ...] | None = None    # the blocks' ids, kept between the calls that change the table


class BlockManager:
    """Hands out KV blocks to sequences, shares them through the prefix cache and fork, frees them LRU."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and "
                             f"{block_size}; give the KV cache more memory or a positive block size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]      # [NB], indexed by block id
        self._free = FreeBlockQueue(self.blocks)
        self._cached: dict[bytes, KVBlock] = {}                    # digest -> registered block
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self.stats = PrefixCacheStats()

    # ---- state -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached-but-free ones included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.stats.hit_rate

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of seq_id's block table (physical block ids, logical order)."""
        return list(self.block_ids(seq_id))

    def block_ids(self, seq_id: Hashable) -> tuple[int, ...]:
        """seq_id's block table (physical block ids, logical order) as a tuple kept until the table changes: a
        running sequence's table changes once a block of tokens, and the scheduler reads it every step."""
        state = self._get(seq_id)
        if state.ids is None:
            state.ids = tuple(b.block_id for b in state.blocks)
        return state.ids

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they will be reused (head first). O(NB): for tests and debugging."""
        return [b.block_id for b in self._free]

    # ---- prefix cache ----------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], hashes: BlockHashes | None = None) -> list[int]:
        """Block ids of the leading full blocks of token_ids already cached, at most (len(token_ids)-1)//BS
        blocks so that at least the last prompt token is recomputed (a fully cached prompt still needs logits).
        hashes: the sequence's digest memo (a throwaway one if None). Takes no refs."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_blocks = max(0, (len(token_ids) - 1) // bs)
        digests = (hashes or BlockHashes()).upto(token_ids, num_blocks, bs)
        hits: list[int] = []
        for i in range(num_blocks):
            block = self._cached.get(digests[i])
            if block is None:
                break
            hits.append(block.block_id)
        self.stats.queries += 1
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += len(hits) * bs
        return hits

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int,
                          hashes: BlockHashes | None = None) -> None:
        """Register the digests of seq_id's blocks that are full and fully computed (num_computed_tokens of
        token_ids) and not yet registered. A block whose digest is already registered under another physical
        block stays unregistered. hashes: the sequence's digest memo (a throwaway one if None)."""
        state = self._get(seq_id)
        bs = self.block_size
        if not 0 <= num_computed_tokens <= min(len(token_ids), len(state.blocks) * bs):
            raise ValueError(f"cache_full_blocks for sequence {seq_id!r}: num_computed_tokens={num_computed_tokens} "
                             f"must lie within the {len(token_ids)} token ids given and the {len(state.blocks) * bs} "
                             f"slots of its blocks; pass the count of tokens whose K/V have been written")
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // bs
        if num_full <= state.num_hashed_blocks:
            return
        digests = (hashes or BlockHashes()).upto(token_ids, num_full, bs)
        for i in range(state.num_hashed_blocks, num_full):
            digest = digests[i]
            block = state.blocks[i]
            if block is DROPPED:
                continue
            if block.block_hash is None:
                if digest not in self._cached:
                    block.block_hash = digest
                    self._cached[digest] = block
            elif block.block_hash != digest:
                raise ValueError(f"block {i} of sequence {seq_id!r} was cached for other tokens than token_ids "
                                 f"holds there; pass the sequence's own token ids to cache_full_blocks")
        state.num_hashed_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every digest; blocks in use keep their data, free ones become plain free blocks."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.stats.cached_free_blocks = 0

    # ---- allocation ------------------------------------------------------------------------------
    def num_blocks_needed(self, seq_id_or_None: Hashable | None, num_computed_tokens: int, num_new_tokens: int,
                          cached_block_ids: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots(seq_id, num_computed_tokens, num_new_tokens, cached_block_ids) would
        consume (fresh blocks, a copy-on-write target, and prefix hits that currently sit on the free list).
        An unknown seq_id or None means a sequence's first allocation."""
        state = self._seqs.get(seq_id_or_None) if seq_id_or_None is not None else None
        return self._num_needed(seq_id_or_None, state, num_computed_tokens, num_new_tokens, cached_block_ids)

    def allocate_slots(self, seq_id: Hashable, num_computed_tokens: int, num_new_tokens: int,
                       cached_block_ids: Sequence[int] = ()) -> Allocation | None:
        """Make seq_id's table cover its num_computed_tokens tokens in the cache plus num_new_tokens about to
        be written. On the first call for a seq, cached_block_ids (from find_cached_prefix) are taken first
        (ref++, removed from the free list if free), and num_computed_tokens must be the tokens they hold.
        Returns None, changing nothing, when there are not enough free blocks. Handles copy-on-write of a
        shared, partially filled block that the new tokens will write into: the table entry is replaced,
        so read block_table after this call."""
        state = self._seqs.get(seq_id)
        if state is not None and not cached_block_ids and self._fits(state.blocks, num_computed_tokens, num_new_tokens):
            return NOTHING_ALLOCATED
        if self._num_needed(seq_id, state, num_computed_tokens, num_new_tokens, cached_block_ids) > len(self._free):
            return None
        if state is None:
            state = self._seqs[seq_id] = _SeqBlocks()
        new_ids: list[int] = []
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._free.remove(block)
                self.stats.cached_free_blocks -= 1
            block.ref_cnt += 1
            state.blocks.append(block)
            new_ids.append(block_id)
        state.num_hashed_blocks = max(state.num_hashed_blocks, len(cached_block_ids))

        num_fresh, cow = self._plan(state.blocks, num_computed_tokens, num_new_tokens)
        copies: list[tuple[int, int]] = []
        if cow:
            index = num_computed_tokens // self.block_size
            src = state.blocks[index]
            dst = self._take_free_block()
            src.ref_cnt -= 1                    # still >= 1: it was shared
            state.blocks[index] = dst
            copies.append((src.block_id, dst.block_id))
        for _ in range(num_fresh):
            block = self._take_free_block()
            state.blocks.append(block)
            new_ids.append(block.block_id)
        state.ids = None
        return Allocation(new_block_ids=tuple(new_ids), copies=tuple(copies))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give child_id a table sharing every block of parent_id (copy-on-write on the next write)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into sequence {child_id!r}: it already has blocks; pick a new id")
        for block in parent.blocks[parent.num_dropped:]:
            block.ref_cnt += 1
        self._seqs[child_id] = _SeqBlocks(list(parent.blocks), parent.num_hashed_blocks, parent.num_dropped)

    def free(self, seq_id: Hashable) -> None:
        """Release every block of seq_id, tail first, and forget the sequence."""
        state = self._get(seq_id)
        del self._seqs[seq_id]
        for block in reversed(state.blocks[state.num_dropped:]):
            self._release(block)

    def release_before(self, seq_id: Hashable, pos: int) -> int:
        """Give back seq_id's blocks that hold only positions < pos (a sliding-window sequence whose next
        queries start at pos or later); returns how many. Their entries become DROPPED."""
        state = self._get(seq_id)
        end = min(max(0, pos) // self.block_size, len(state.blocks))
        released = 0
        for i in range(state.num_dropped, end):
            self._release(state.blocks[i])
            state.blocks[i] = DROPPED
            state.ids = None
            released += 1
        state.num_dropped = max(state.num_dropped, end)
        return released

    def truncate(self, seq_id: Hashable, num_tokens: int) -> int:
        """Give back seq_id's trailing blocks past the ceil(num_tokens / BS) that hold its first num_tokens tokens
        (slots written for speculated tokens that were rejected); returns how many. Registered blocks stay."""
        state, keep = self._get(seq_id), -(-max(0, num_tokens) // self.block_size)
        if keep < state.num_hashed_blocks:
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {num_tokens} tokens: its first "
                             f"{state.num_hashed_blocks} blocks are in the prefix cache; free it to recompute")
        released = max(0, len(state.blocks) - max(keep, state.num_dropped))
        for _ in range(released):
            self._release(state.blocks.pop())
            state.ids = None
        return released

    def _release(self, block: KVBlock) -> None:
        """Drop one reference to block; at zero it goes to the free list (to its head if it holds no
        cached prefix: reuse it first)."""
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self._free.appendleft(block)
            else:
                self._free.append(block)
                self.stats.cached_free_blocks += 1

    # ---- internals -------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _SeqBlocks:
        state = self._seqs.get(seq_id)
        if state is None:
            raise KeyError(f"sequence {seq_id!r} has no KV blocks (never allocated, or already freed); "
                           f"call allocate_slots for it first")
        return state

    def _num_needed(self, seq_id: Hashable, state: _SeqBlocks | None, num_computed_tokens: int,
                    num_new_tokens: int, cached_block_ids: Sequence[int]) -> int:
        cached = self._check_allocation(seq_id, state, num_computed_tokens, num_new_tokens, cached_block_ids)
        blocks = state.blocks if state is not None else cached
        num_fresh, cow = self._plan(blocks, num_computed_tokens, num_new_tokens)
        return num_fresh + int(cow) + sum(1 for b in cached if b.ref_cnt == 0)

    def _check_allocation(self, seq_id: Hashable, state: _SeqBlocks | None, num_computed_tokens: int,
                          num_new_tokens: int, cached_block_ids: Sequence[int]) -> list[KVBlock]:
        """Validate the arguments of an allocation; return the prefix-hit blocks."""
        bs = self.block_size
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_computed_tokens={num_computed_tokens} and "
                             f"num_new_tokens={num_new_tokens}")
        if state is not None:
            if cached_block_ids:
                raise ValueError(f"sequence {seq_id!r} already has blocks; pass cached_block_ids only on its first "
                                 f"allocate_slots call")
            if num_computed_tokens > len(state.blocks) * bs:
                raise ValueError(f"sequence {seq_id!r} has {len(state.blocks)} blocks, too few for "
                                 f"num_computed_tokens={num_computed_tokens}; pass the tokens its K/V cover")
            if -(-(num_computed_tokens + num_new_tokens) // bs) < len(state.blocks):
                raise ValueError(f"sequence {seq_id!r} already has {len(state.blocks)} blocks and cannot shrink to "
                                 f"{num_computed_tokens + num_new_tokens} tokens; free it and allocate again to "
                                 f"recompute")
            return []
        if num_computed_tokens != len(cached_block_ids) * bs:
            raise ValueError(f"a new sequence's num_computed_tokens ({num_computed_tokens}) must be the "
                             f"{len(cached_block_ids) * bs} tokens of its {len(cached_block_ids)} cached blocks")
        if len(set(cached_block_ids)) != len(cached_block_ids):
            raise ValueError(f"cached_block_ids {list(cached_block_ids)} repeats a block; pass the list "
                             f"find_cached_prefix returned")
        blocks = []
        for block_id in cached_block_ids:
            if not 0 <= block_id < self.num_blocks or self.blocks[block_id].block_hash is None:
                raise ValueError(f"block {block_id} is not in the prefix cache (evicted since the lookup?); call "
                                 f"find_cached_prefix right before allocate_slots")
            blocks.append(self.blocks[block_id])
        return blocks

    def _fits(self, blocks: list[KVBlock], num_computed_tokens: int, num_new_tokens: int) -> bool:
        """The common decode case, decided without the general path's checks: a sequence's table already ends
        in the block its new tokens end in, and they start in a fresh slot or a block it owns alone (nothing
        to allocate or copy; every argument check of the general path holds)."""
        bs, start = self.block_size, num_computed_tokens
        if num_new_tokens <= 0 or start < 0 or -(-(start + num_new_tokens) // bs) != len(blocks):
            return False
        return start % bs == 0 or blocks[start // bs].ref_cnt == 1

    def _plan(self, blocks: Sequence[KVBlock], num_computed_tokens: int, num_new_tokens: int) -> tuple[int, bool]:
        """(fresh blocks to append, whether the block the next token goes into must be copied first)."""
        bs = self.block_size
        num_fresh = max(0, -(-(num_computed_tokens + num_new_tokens) // bs) - len(blocks))
        cow = (num_new_tokens > 0 and num_computed_tokens % bs != 0
               and blocks[num_computed_tokens // bs].ref_cnt > 1)
        return num_fresh, cow

    def _take_free_block(self) -> KVBlock:
        """Pop the head of the free list for new data, evicting its prefix-cache entry."""
        block = self._free.popleft()
        assert block.ref_cnt == 0, f"{block!r} on the free list is in use"
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            self.stats.evicted_blocks += 1
            self.stats.cached_free_blocks -= 1
        block.ref_cnt = 1
        return block

    # ---- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert every structural invariant (O(NB + table sizes)); raises AssertionError with detail."""
        nb, bs = self.num_blocks, self.block_size
        free_nodes = self._free.check_links(limit=nb)
        free_ids = [b.block_id for b in free_nodes]
        assert len(set(free_ids)) == len(free_ids), f"a block is on the free list twice: {free_ids}"
        owners = [0] * nb
        for seq_id, state in self._seqs.items():
            assert all(b is DROPPED for b in state.blocks[:state.num_dropped]) and \
                all(b is not DROPPED for b in state.blocks[state.num_dropped:]), \
                f"sequence {seq_id!r}: given-back entries must be exactly its first {state.num_dropped}"
            assert state.ids is None or state.ids == tuple(b.block_id for b in state.blocks), \
                f"sequence {seq_id!r}: kept block ids {state.ids} are not its table's"
            ids = [b.block_id for b in state.blocks[state.num_dropped:]]
            assert len(set(ids)) == len(ids), f"sequence {seq_id!r} holds a block twice: {ids}"
            assert state.num_hashed_blocks <= len(state.blocks), \
                f"sequence {seq_id!r} hashed {state.num_hashed_blocks} blocks but has {len(state.blocks)}"
            for i, block in enumerate(state.blocks):
                if i < state.num_dropped:
                    continue
                assert self.blocks[block.block_id] is block, f"sequence {seq_id!r} holds a foreign {block!r}"
                assert block.block_hash is None or i < state.num_hashed_blocks, \
                    f"sequence {seq_id!r}: block {i} ({block!r}) is registered past its hashed, full blocks"
                owners[block.block_id] += 1
        on_free = set(free_ids)
        num_used = 0
        for block in self.blocks:
            assert block.ref_cnt == owners[block.block_id], \
                f"{block!r} has ref_cnt {block.ref_cnt} but {owners[block.block_id]} table entries"
            assert (block.ref_cnt == 0) == (block.block_id in on_free), \
                f"{block!r}: on free list = {block.block_id in on_free}, ref_cnt = {block.ref_cnt}"
            num_used += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block!r} has a digest the cache map lacks"
        assert len(self._free) + num_used == nb, f"{len(self._free)} free + {num_used} used != {nb} blocks"
        cached_free = sum(b.block_hash is not None for b in free_nodes)
        assert self.stats.cached_free_blocks == cached_free, \
            f"stats count {self.stats.cached_free_blocks} cached free blocks, the free list holds {cached_free}"
        for digest, block in self._cached.items():
            assert block.block_hash == digest, f"cache map key {digest.hex()[:8]} points at {block!r}"
