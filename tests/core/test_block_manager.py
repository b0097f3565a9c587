"""Tests of the paged KV block manager: unit cases plus a randomized simulation of a KV pool."""

from __future__ import annotations

import dataclasses
import random

import pytest

from rawinfer.core import block_hashes
from rawinfer.core.block_hashes import ROOT_HASH, BlockHashes, hash_block_tokens
from rawinfer.core.block_manager import Allocation, BlockManager


def snapshot(bm: BlockManager, seq_ids) -> tuple:
    """Everything allocate_slots could change, for 'nothing changed' checks."""
    return ({s: bm.block_table(s) for s in seq_ids if s in bm}, bm.free_block_ids(),
            [(b.ref_cnt, b.block_hash) for b in bm.blocks], dataclasses.astuple(bm.stats))


def run_prompt(bm: BlockManager, seq_id, tokens, use_cache: bool = True) -> Allocation:
    """Admit a sequence, 'compute' its whole prompt in one step and register its full blocks."""
    cached = bm.find_cached_prefix(tokens) if use_cache else []
    computed = len(cached) * bm.block_size
    alloc = bm.allocate_slots(seq_id, computed, len(tokens) - computed, cached)
    assert alloc is not None
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return alloc


# ---- unit tests ----------------------------------------------------------------------------------------
def test_allocate_grows_the_table_block_by_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    alloc = bm.allocate_slots("a", 0, 10)
    assert alloc == Allocation(new_block_ids=(0, 1, 2), copies=())
    assert bm.block_table("a") == [0, 1, 2]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (5, 3, 3 / 8)
    assert bm.allocate_slots("a", 10, 2) == Allocation((), ())
    assert bm.num_blocks_needed("a", 12, 1) == 1
    assert bm.allocate_slots("a", 12, 1).new_block_ids == (3,)
    assert bm.num_blocks_needed(None, 0, 17) == 5
    assert bm.allocate_slots("b", 0, 1).new_block_ids == (4,)
    bm.check_invariants()
    table = bm.block_table("a")
    table.append(99)                            # a copy: the manager's table is untouched
    assert bm.block_table("a") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot shrink"):
        bm.allocate_slots("a", 5, 0)
    with pytest.raises(ValueError, match="too few"):
        bm.allocate_slots("a", 17, 1)           # 4 blocks cannot hold 17 computed tokens
    with pytest.raises(ValueError, match="must be the 0 tokens"):
        bm.allocate_slots("c", 3, 1)            # a new sequence has computed only its prefix hits


def test_exhaustion_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    run_prompt(bm, "a", list(range(9)))         # 3 blocks, 2 cached
    before = snapshot(bm, ["a", "b"])
    assert bm.num_blocks_needed("b", 0, 8) == 2 > bm.num_free_blocks
    assert bm.allocate_slots("b", 0, 8) is None
    assert bm.allocate_slots("a", 9, 8) is None   # growing to 17 tokens needs 2 blocks, 1 free
    assert snapshot(bm, ["a", "b"]) == before
    assert "b" not in bm
    bm.free("a")
    # Now the 2 cached blocks of "a" are free; a hit on them plus 3 fresh blocks needs 5 > 4.
    cached = bm.find_cached_prefix(list(range(9)))
    assert cached == [0, 1]
    before = snapshot(bm, ["c"])
    assert bm.num_blocks_needed("c", 8, 12, cached) == 5
    assert bm.allocate_slots("c", 8, 12, cached) is None
    assert snapshot(bm, ["c"]) == before
    assert bm.allocate_slots("c", 8, 8, cached).new_block_ids[:2] == (0, 1)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_prefix_hit_reuses_blocks_and_recomputes_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    run_prompt(bm, "a", prompt)
    a = bm.block_table("a")
    # A fully cached 12-token prompt hits only 2 blocks: the last token must be recomputed for its logits.
    assert bm.find_cached_prefix(prompt) == a[:2]
    assert bm.find_cached_prefix(prompt + [1]) == a[:3]
    assert bm.find_cached_prefix(prompt[:4]) == []
    assert bm.find_cached_prefix(prompt[:5]) == a[:1]
    assert bm.find_cached_prefix([5, 6, 7, 8, 9, 99, 11, 12, 13]) == a[:1]   # diverges in block 1
    assert bm.find_cached_prefix([0] + prompt) == []                          # same blocks, shifted
    cached = bm.find_cached_prefix(prompt + [1, 2])
    assert bm.num_blocks_needed("b", 12, 2, cached) == 1                      # blocks of "a" are in use
    alloc = bm.allocate_slots("b", 12, 2, cached)
    assert list(alloc.new_block_ids[:3]) == a and alloc.copies == ()
    assert [bm.blocks[i].ref_cnt for i in a] == [2, 2, 2]
    bm.cache_full_blocks("b", prompt + [1, 2], 14)
    bm.check_invariants()
    bm.free("a")
    assert [bm.blocks[i].ref_cnt for i in a] == [1, 1, 1]
    bm.free("b")
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_lru_evicts_the_least_recently_freed_block_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    prompts = {"a": [1, 2, 0], "b": [3, 4, 0], "c": [5, 6, 0]}   # one full (cached) block each...
    for s, p in prompts.items():
        bm.allocate_slots(s, 0, 2)                               # ...by allocating only that block
        bm.cache_full_blocks(s, p, 2)
    first = {s: bm.block_table(s)[0] for s in prompts}
    for s in ("b", "a", "c"):
        bm.free(s)
    assert bm.free_block_ids() == [first["b"], first["a"], first["c"]]
    assert bm.allocate_slots("d", 0, 1).new_block_ids == (first["b"],)
    assert bm.stats.evicted_blocks == 1
    assert bm.find_cached_prefix(prompts["b"]) == []
    assert bm.find_cached_prefix(prompts["a"]) == [first["a"]]
    assert bm.find_cached_prefix(prompts["c"]) == [first["c"]]
    assert bm.allocate_slots("e", 0, 1).new_block_ids == (first["a"],)
    bm.check_invariants()


def test_release_is_tail_first_so_prefixes_outlive_their_tails():
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    run_prompt(bm, "a", tokens)                 # blocks 0,1,2 full and cached, block 3 partial
    assert bm.block_table("a") == [0, 1, 2, 3]
    bm.free("a")
    # The partial block holds nothing reusable and goes first; then the chain from its tail back.
    assert bm.free_block_ids() == [3, 2, 1, 0]
    bm.allocate_slots("x", 0, 4)                # takes blocks 3 and 2
    assert bm.find_cached_prefix(tokens) == [0, 1]
    bm.check_invariants()


def test_a_hit_takes_a_cached_block_out_of_the_middle_of_the_free_list():
    bm = BlockManager(num_blocks=6, block_size=2)
    for s, p in {"a": [1, 1, 9], "b": [2, 2, 9], "c": [3, 3, 9]}.items():
        bm.allocate_slots(s, 0, 2)
        bm.cache_full_blocks(s, p, 2)
    blocks = {s: bm.block_table(s)[0] for s in "abc"}
    for s in "abc":
        bm.free(s)
    order = bm.free_block_ids()
    assert order[-3:] == [blocks["a"], blocks["b"], blocks["c"]]
    cached = bm.find_cached_prefix([2, 2, 9])
    assert cached == [blocks["b"]]
    assert bm.allocate_slots("d", 2, 1, cached).new_block_ids[0] == blocks["b"]
    rest = [b for b in order if b != blocks["b"]][1:]          # one fresh block was popped from the head
    assert bm.free_block_ids() == rest
    bm.check_invariants()
    bm.free("d")                                # the hit block is now the most recently freed
    assert bm.free_block_ids()[-1] == blocks["b"]
    bm.check_invariants()


def test_copy_on_write_after_fork():
    bm = BlockManager(num_blocks=6, block_size=4)
    run_prompt(bm, "p", [1, 2, 3, 4, 5, 6])     # block 0 full, block 1 holds 2 of 4 tokens
    bm.fork("p", "c")
    p0, p1 = bm.block_table("p")
    assert bm.block_table("c") == [p0, p1]
    assert bm.blocks[p0].ref_cnt == bm.blocks[p1].ref_cnt == 2
    bm.check_invariants()
    assert bm.num_blocks_needed("p", 6, 1) == 1
    alloc = bm.allocate_slots("p", 6, 1)        # p writes position 6 into the shared block 1
    dst = alloc.copies[0][1]
    assert alloc == Allocation(new_block_ids=(), copies=((p1, dst),))
    assert bm.block_table("p") == [p0, dst] and bm.block_table("c") == [p0, p1]
    assert bm.blocks[p1].ref_cnt == 1
    assert bm.allocate_slots("c", 6, 1) == Allocation((), ())   # c is now the sole owner of p1
    assert bm.allocate_slots("c", 7, 1) == Allocation((), ())
    bm.check_invariants()
    # A fork whose last block is full shares nothing that will be written: no copy, a new block.
    bm.cache_full_blocks("c", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    bm.fork("c", "g")
    alloc = bm.allocate_slots("g", 8, 1)
    assert alloc.copies == () and len(alloc.new_block_ids) == 1
    bm.check_invariants()
    for s in ("p", "c", "g"):
        bm.free(s)
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_copy_on_write_that_does_not_fit_returns_none():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate_slots("p", 0, 6)
    bm.fork("p", "c")
    before = snapshot(bm, ["p", "c"])
    assert bm.num_blocks_needed("p", 6, 1) == 1 and bm.num_free_blocks == 0
    assert bm.allocate_slots("p", 6, 1) is None
    assert snapshot(bm, ["p", "c"]) == before
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork("p", "c")


def test_hit_counters_count_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    assert bm.prefix_cache_hit_rate == 0.0
    run_prompt(bm, "a", list(range(10)))                     # 10 tokens queried, 0 hit
    run_prompt(bm, "b", list(range(10)))                     # 10 queried, 8 hit
    bm.find_cached_prefix(list(range(20)))                   # 20 queried, 8 hit
    assert (bm.stats.queries, bm.stats.query_tokens, bm.stats.hit_tokens) == (3, 40, 16)
    assert bm.prefix_cache_hit_rate == pytest.approx(16 / 40)


def test_each_block_is_hashed_once_through_the_sequences_memo(monkeypatch):
    """A sequence's digests, kept in its BlockHashes, serve the lookup, the registrations as blocks fill
    and a later lookup after preemption: every full block is hashed exactly once."""
    calls = []
    real = block_hashes.hash_block_tokens
    monkeypatch.setattr(block_hashes, "hash_block_tokens", lambda p, t: (calls.append(tuple(t)), real(p, t))[1])
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens, hashes = list(range(10)), BlockHashes()
    assert bm.find_cached_prefix(tokens, hashes) == [] and len(calls) == 2       # blocks 0 and 1
    bm.allocate_slots("a", 0, 10)
    bm.cache_full_blocks("a", tokens, 10, hashes)
    tokens += [10, 11, 12]
    bm.allocate_slots("a", 10, 3)
    bm.cache_full_blocks("a", tokens, 13, hashes)                                # block 2 fills
    bm.free("a")                                                                 # preempted...
    assert bm.find_cached_prefix(tokens, hashes) == bm.find_cached_prefix(tokens)[:3]
    assert calls[:3] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)] and len(calls) == 3 + 3
    assert hashes.digests == BlockHashes().upto(tokens, 3, 4)                    # the same chain


def test_hash_collisions_never_share_blocks():
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert h != hash_block_tokens(ROOT_HASH, [2, 1])
    assert h != hash_block_tokens(hash_block_tokens(ROOT_HASH, [1, 2]), [1, 2])   # same tokens, other parent
    assert hash_block_tokens(ROOT_HASH, [-1]) != hash_block_tokens(ROOT_HASH, [-2])  # Python's hash() collides
    assert hash_block_tokens(ROOT_HASH, [256, 0]) != hash_block_tokens(ROOT_HASH, [1, 0])
    with pytest.raises(OverflowError):
        hash_block_tokens(ROOT_HASH, [2**31])
    bm = BlockManager(num_blocks=64, block_size=2)
    prompts = [[a, b, c, d, 0] for a in range(2) for b in range(2) for c in range(2) for d in range(2)]
    for i, p in enumerate(prompts):
        run_prompt(bm, i, p)
    tables = [bm.block_table(i) for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        for j, q in enumerate(prompts):
            shared = len(set(tables[i]) & set(tables[j]))
            # Blocks are shared exactly as far as the prompts agree block by block from the start.
            agree = 0
            while agree < 2 and p[2 * agree:2 * agree + 2] == q[2 * agree:2 * agree + 2]:
                agree += 1
            assert shared == (3 if i == j else agree), (p, q)
    assert len(set(b.block_hash for b in bm.blocks if b.block_hash is not None)) == bm.num_cached_blocks == 4 + 16


def test_duplicate_blocks_computed_side_by_side_stay_uncached():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [7, 7, 8, 8, 9]
    for s in ("a", "b"):                        # both admitted before either is computed: no hits
        cached = bm.find_cached_prefix(tokens)
        assert bm.allocate_slots(s, 2 * len(cached), 5 - 2 * len(cached), cached) is not None
    for s in ("a", "b"):
        bm.cache_full_blocks(s, tokens, 5)
    assert bm.num_cached_blocks == 2
    a, b = bm.block_table("a"), bm.block_table("b")
    assert all(bm.blocks[i].block_hash is None for i in b)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    # b's blocks (uncached) sit at the head so they are reused before a's cached ones.
    assert set(bm.free_block_ids()[:3]) == set(b) and bm.free_block_ids()[-2:] == [a[1], a[0]]
    assert bm.find_cached_prefix(tokens) == a[:2]


def test_stale_or_bad_cached_ids_are_rejected():
    bm = BlockManager(num_blocks=3, block_size=2)
    run_prompt(bm, "a", [1, 2, 3])
    bm.free("a")
    cached = bm.find_cached_prefix([1, 2, 3])
    assert bm.allocate_slots("b", 0, 6) is not None        # evicts every block, the cached one included
    with pytest.raises(ValueError, match="not in the prefix cache"):
        bm.allocate_slots("c", 2, 1, cached)
    with pytest.raises(ValueError, match="first"):
        bm.allocate_slots("b", 6, 0, [0])
    with pytest.raises(ValueError, match=">= 0"):
        bm.allocate_slots("b", 6, -1)
    assert "c" not in bm
    bm.check_invariants()


def test_unknown_sequence_errors_are_clear():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots(3, 0, 2)
    bm.free(3)
    with pytest.raises(KeyError, match="already freed"):
        bm.free(3)                              # no double free
    with pytest.raises(KeyError, match="has no KV blocks"):
        bm.block_table("nope")
    with pytest.raises(KeyError):
        bm.fork("nope", "x")
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(num_blocks=0, block_size=16)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_prefix_caching_disabled_and_reset():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prompt(bm, "a", [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [] and bm.num_cached_blocks == 0
    bm = BlockManager(num_blocks=8, block_size=2)
    run_prompt(bm, "a", [1, 2, 3, 4, 5])
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix([1, 2, 3, 4, 5]) == []
    bm.check_invariants()
    bm.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)           # already passed: not registered again
    assert bm.num_cached_blocks == 0


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", 0, 3)
    bm.check_invariants()
    bm.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        bm.check_invariants()
    bm.blocks[0].ref_cnt -= 1
    bm.blocks[3].prev_free = bm.blocks[1]
    with pytest.raises(AssertionError, match="prev_free"):
        bm.check_invariants()


# ---- randomized simulation -----------------------------------------------------------------------------
@dataclasses.dataclass
class SimSeq:
    tokens: list[int]
    computed: int = 0


class PoolSim:
    """Drives a BlockManager like a scheduler + model runner would, and models what each KV slot holds.

    A slot's content is the token prefix whose last token wrote it, so a block returned by a prefix hit is
    correct exactly when its slots hold the queried prefixes, and a sequence's table is intact exactly when
    its computed slots still hold its own prefixes.
    """

    def __init__(self, seed: int, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.bs = block_size
        self.kv: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]   # [NB][BS]
        self.seqs: dict[int, SimSeq] = {}
        self.waiting: list[list[int]] = []
        self.next_id = 0
        self.max_len = 6 * block_size + 3
        vocab = 3                                # tiny vocabulary: shared prefixes and hits are common
        self.templates = [[self.rng.randrange(vocab) for _ in range(self.rng.randrange(0, 4 * block_size))]
                          for _ in range(4)]
        self.vocab = vocab
        self.counts = dict(hits=0, copies=0, none=0, forks=0)

    def new_prompt(self) -> list[int]:
        if self.waiting and self.rng.random() < 0.5:
            return self.waiting.pop(self.rng.randrange(len(self.waiting)))
        base = list(self.rng.choice(self.templates))
        return base + [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(1, 2 * self.bs))]

    def write(self, seq_id: int, start: int, end: int) -> None:
        seq, table = self.seqs[seq_id], self.bm.block_table(seq_id)
        for p in range(start, end):
            block = table[p // self.bs]
            assert self.bm.blocks[block].ref_cnt == 1, f"seq {seq_id} writes into shared block {block}"
            self.kv[block][p % self.bs] = tuple(seq.tokens[:p + 1])

    def check_prefix(self, tokens: list[int], block_ids: list[int]) -> None:
        for i, block in enumerate(block_ids):
            for r in range(self.bs):
                assert self.kv[block][r] == tuple(tokens[:i * self.bs + r + 1]), (tokens, i, block)

    def allocate(self, seq_id: int, computed: int, total: int, cached=()) -> bool:
        """Allocate, check None means 'nothing changed' and the block accounting, run the copies."""
        bm = self.bm
        needed = bm.num_blocks_needed(seq_id, computed, total - computed, cached)
        free_before, old_table = bm.num_free_blocks, bm.block_table(seq_id) if seq_id in bm else []
        before = snapshot(bm, [seq_id])
        alloc = bm.allocate_slots(seq_id, computed, total - computed, cached)
        if alloc is None:
            assert needed > free_before
            assert snapshot(bm, [seq_id]) == before
            self.counts["none"] += 1
            return False
        assert needed <= free_before and bm.num_free_blocks == free_before - needed
        table = bm.block_table(seq_id)
        assert table[len(table) - len(alloc.new_block_ids):] == list(alloc.new_block_ids)
        for src, dst in alloc.copies:
            index = old_table.index(src)
            assert table[index] == dst and bm.blocks[dst].ref_cnt == 1
            self.kv[dst] = list(self.kv[src])
            self.counts["copies"] += 1
        return True

    def step_seq(self, seq_id: int) -> None:
        """One scheduler step for a running sequence: its next prefill chunk or one decode token."""
        seq = self.seqs[seq_id]
        if seq.computed == len(seq.tokens):
            if len(seq.tokens) >= self.max_len:
                self.finish(seq_id)
                return
            seq.tokens.append(self.rng.randrange(self.vocab))
        total = min(len(seq.tokens), seq.computed + self.rng.randrange(1, 3 * self.bs))
        if not self.allocate(seq_id, seq.computed, total):
            self.finish(seq_id, preempted=True)
            return
        self.write(seq_id, seq.computed, total)
        seq.computed = total
        self.bm.cache_full_blocks(seq_id, seq.tokens, seq.computed)

    def admit(self) -> None:
        tokens = self.new_prompt()
        cached = self.bm.find_cached_prefix(tokens)
        assert len(cached) <= (len(tokens) - 1) // self.bs
        self.check_prefix(tokens, cached)
        self.counts["hits"] += len(cached)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        start = len(cached) * self.bs
        total = min(len(tokens), start + self.rng.randrange(1, 3 * self.bs))
        if not self.allocate(seq_id, start, total, cached):
            self.waiting.append(tokens)
            return
        self.seqs[seq_id] = SimSeq(tokens, start)
        self.write(seq_id, start, total)
        self.seqs[seq_id].computed = total
        self.bm.cache_full_blocks(seq_id, tokens, total)

    def fork(self) -> None:
        ready = [s for s, q in self.seqs.items() if q.computed == len(q.tokens)]
        if ready:
            parent = self.rng.choice(ready)
            child, self.next_id = self.next_id, self.next_id + 1
            self.bm.fork(parent, child)
            self.seqs[child] = SimSeq(list(self.seqs[parent].tokens), self.seqs[parent].computed)
            self.counts["forks"] += 1

    def finish(self, seq_id: int, preempted: bool = False) -> None:
        self.bm.free(seq_id)
        seq = self.seqs.pop(seq_id)
        if preempted:
            self.waiting.append(seq.tokens)

    def check(self) -> None:
        self.bm.check_invariants()
        for seq_id, seq in self.seqs.items():
            table = self.bm.block_table(seq_id)
            assert len(table) == -(-seq.computed // self.bs), (seq_id, len(table), seq.computed)
            self.check_prefix(seq.tokens[:seq.computed - seq.computed % self.bs], table[:seq.computed // self.bs])
            for p in range(seq.computed - seq.computed % self.bs, seq.computed):
                assert self.kv[table[p // self.bs]][p % self.bs] == tuple(seq.tokens[:p + 1])

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            r = self.rng.random()
            if r < 0.25 or not self.seqs:
                self.admit()
            elif r < 0.75:
                self.step_seq(self.rng.choice(list(self.seqs)))
            elif r < 0.82:
                self.fork()
            elif r < 0.995:
                self.finish(self.rng.choice(list(self.seqs)))
            else:
                self.bm.reset_prefix_cache()
            self.check()
        for seq_id in list(self.seqs):
            self.finish(seq_id)
        self.check()
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.num_used_blocks == 0


@pytest.mark.parametrize("seed,num_blocks,block_size", [
    (0, 24, 4), (1, 24, 4), (2, 16, 2), (3, 40, 8), (4, 12, 1), (5, 32, 3),
])
def test_random_simulation_keeps_invariants_and_kv_contents(seed, num_blocks, block_size):
    sim = PoolSim(seed, num_blocks, block_size)
    sim.run(4000)
    # The run must have exercised every path it claims to test.
    assert sim.counts["hits"] > 0 and sim.counts["none"] > 0
    assert sim.counts["copies"] > 0 or block_size == 1          # with BS 1 no block is ever partially filled
    assert sim.counts["forks"] > 0 and sim.bm.stats.evicted_blocks > 0
    assert 0.0 < sim.bm.prefix_cache_hit_rate < 1.0


def test_random_simulation_without_prefix_caching():
    sim = PoolSim(7, 20, 4, prefix_caching=False)
    sim.run(1500)
    assert sim.counts["hits"] == 0 and sim.bm.num_cached_blocks == 0 and sim.counts["copies"] > 0
