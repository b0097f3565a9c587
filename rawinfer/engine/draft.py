"""DraftProposer: speculative tokens predicted greedily by a smaller model that shares the target's tokenizer,
run in this process, whose KV cache follows each target sequence's accepted tokens.

The draft model has its own backend, runner and block manager, built as LLMEngine builds the target's but
with no scheduler or sampler. Its memory is a region of the target's pool: plan_draft reads the draft's
config before the target's pool is sized, the target's MemoryPool leaves room for it (guest=), sharing its KV
region so that both models hold the same number of tokens, and the draft's pool carves that room; the engine
makes one allocation (built alone, as tests do, a DraftProposer allocates a pool of its own). This module
builds its step plans itself (core/step_plan.py) and reads the logits with an argmax. Nothing here samples,
finishes or caches a prefix.

Per target sequence the proposer keeps a mirror, a private Sequence of the draft side whose first
num_computed_tokens ids are exactly those whose K/V the draft's cache holds (the drafts it computed last
time included). A call to propose() then, per sequence:

    common = longest common prefix of (mirror's computed ids, target's token_ids), below the last token
    truncate the draft's blocks to `common` (blocks wholly past it go back to the free list)
    catch up: compute target.token_ids[common:]        one batched pass (more when the step budget is short)
    draft k tokens: the argmax after the catch-up, then k - 1 batched decode passes on the drafts

A short catch-up (the usual one: after all k drafts were kept, the last draft and the target's own token)
runs as decode rows, laid out as the target verifies drafts, so it takes the decode path (and on CUDA its
graphs) instead of a prefill chunk's. Rejected drafts, a preempted and recomputed sequence, or a new one
all take the same path. The draft's block manager runs without prefix caching: no block that held a
rejected token can ever be found again. A sequence that does not fit the draft's pool or context gets no
proposal ([]), never an error. A draft model whose every layer slides through a window of W positions gives
back the blocks wholly before each sequence's window after every call, as the scheduler does for the target.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Hashable
from typing import Any

from rawinfer.backend.select import get_backend
from rawinfer.config import EngineConfig, ModelConfig, resolve_max_model_len
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.sequence import Sequence
from rawinfer.core.step_plan import ScheduledSeq, build_step_plan
from rawinfer.exec.graphs import DecodeGraphs
from rawinfer.exec.memory import GuestPool, MemoryPool
from rawinfer.exec.model import DecoderModel
from rawinfer.exec.runner import ModelRunner
from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")

DRAFT_KV_SHARE = 4                  # a draft built alone: its KV memory is the --kv-cache-memory divided by this ...
DEFAULT_DRAFT_KV_BYTES = 256 << 20  # ... or this when that is sized automatically
WARM_K = 3                          # the warm-up's drafts per sequence (two decode passes after the catch-up)
WARM_BATCH = 8                      # and its widest decode pass: past the matrix-vector kernels' few rows
DECODE_CATCH_UP = 8                 # catch-ups of at most this many ids (each sequence's) run decode-shaped
_GREEDY = SamplingParams(temperature=0.0)


def draft_engine_config(draft: ModelConfig, target: ModelConfig, ecfg: EngineConfig) -> EngineConfig:
    """The draft model's engine options: the target's device, threads and kernels; a smaller pool of its own without
    prefix caching; a context no longer than the target's; no speculation of its own."""
    kv = ecfg.kv_cache_memory // DRAFT_KV_SHARE if ecfg.kv_cache_memory else DEFAULT_DRAFT_KV_BYTES
    max_len = min(resolve_max_model_len(target, ecfg), draft.max_position_embeddings)
    return dataclasses.replace(
        ecfg, kv_cache_memory=kv, kv_cache_dtype="auto", enable_prefix_caching=False, max_model_len=max_len,
        int8_activations=ecfg.int8_activations and draft.quant in ("int8", "q4"), chat_template=None,
        speculative_method=None, speculative_model=None)


@dataclasses.dataclass
class DraftSetup:
    """The draft model as planned before any memory is taken: its config, engine options and backend."""
    model_dir: str
    config: ModelConfig
    engine_config: EngineConfig
    backend: Any
    graphs: bool                    # decode graphs (CUDA): a padding block and the graphs' workspace
    extra: dict

    def pool_request(self) -> GuestPool:
        """The draft's pool as a guest of the target's (MemoryPool(guest=...)): one allocation for both."""
        return MemoryPool.guest_request(self.config, self.engine_config, self.backend, padding_block=self.graphs,
                                        extra_workspace=self.extra, owner=self)


def plan_draft(model_dir: str, target_config: ModelConfig, engine_config: EngineConfig) -> DraftSetup:
    """Read the draft model's config and check it can draft for the target (its vocabulary, its format on this
    backend) before anything is allocated or loaded."""
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.vocab_size != target_config.vocab_size:
        target = target_config.source or target_config.architecture
        raise ValueError(
            f"the draft model {model_dir} ({cfg.architecture}, {cfg.vocab_size} tokens) does not share the "
            f"tokenizer of the model ({target}, {target_config.architecture}, {target_config.vocab_size} "
            "tokens); give --speculative-model a conversion of the same family as the model (e.g. its q4 or "
            "int8 copy), or use --speculative-method ngram")
    ecfg = draft_engine_config(cfg, target_config, engine_config)
    backend = get_backend(ecfg.device, ecfg.num_threads, ecfg.cpu_int_gemm, ecfg.cache_dir, ecfg.batch_invariant,
                          ecfg.int8_activations)
    if cfg.quant is not None and cfg.quant not in backend.capabilities.quantized_weights:
        raise ValueError(f"the draft model {model_dir} has {cfg.quant} weights, which run on the CPU backend "
                         f"only; give --speculative-model a copy converted {backend.capabilities.conversions()} "
                         f"for --device {backend.name}")
    return DraftSetup(model_dir, cfg, ecfg, backend, *DecodeGraphs.pool_options(cfg, ecfg, backend))


class DraftProposer:
    """Proposes up to k tokens per sequence: what the draft model generates greedily after its token ids."""

    method = "draft"

    def __init__(self, model_dir: str, target_config: ModelConfig, engine_config: EngineConfig,
                 host: MemoryPool | None = None):
        """host: the target's pool, built with guest=DraftSetup.pool_request(); the draft's weights and KV are
        then carved from the room it left (KV for as many tokens as the target's). Without one the draft
        allocates a pool of its own."""
        if host is not None and host.guest is not None:
            setup = host.guest.owner
            pool_args = {"kv_bytes": host.guest_kv_bytes, "region": host.guest_region}
        else:
            setup, pool_args = plan_draft(model_dir, target_config, engine_config), {}
        cfg, ecfg = setup.config, setup.engine_config
        self.model_dir, self.config = model_dir, ecfg
        self._load(setup, pool_args)
        self.block_manager = BlockManager(self.pool.kv.num_blocks, ecfg.block_size, enable_prefix_caching=False)
        self.layout = self.runner.plan_layout
        self.max_model_len = resolve_max_model_len(cfg, ecfg)
        self.max_tokens, self.max_seqs = ecfg.max_num_batched_tokens, ecfg.max_num_seqs
        self._mirrors: dict[Hashable, Sequence] = {}
        self.window = cfg.kv_window                     # every layer slides through W positions (0: none)
        self._dropped: dict[Hashable, int] = {}         # seq id -> positions below this were given back (window)
        if ecfg.warmup:
            self._warm_up()

    def _load(self, setup: DraftSetup, pool_args: dict) -> None:
        """Memory pool, weights and runner of the draft model, built as LLMEngine builds the target's."""
        self.backend = setup.backend
        self.pool = MemoryPool(setup.config, setup.engine_config, self.backend, padding_block=setup.graphs,
                               extra_workspace=setup.extra, **pool_args)
        self.model = DecoderModel(setup.config, self.pool)
        self.runner = ModelRunner(self.model, graphs=setup.graphs)
        t0 = time.monotonic()
        self.pool.load_weights(setup.model_dir)
        self.model.weights_loaded()
        self.pool.prefault_kv()
        log.info("draft model %s loaded in %.2f s; %s", setup.model_dir, time.monotonic() - t0, self.pool.describe())

    def _warm_up(self) -> None:
        """Propose once for each kind of pass proposing runs, so that no request waits for a kernel to compile
        (or a decode graph to be captured): catch-up prompts of many, some and few tokens, decode passes of
        one, a few and many sequences, and a pass that mixes new prompts with sequences catching up one token.
        Nothing of it stays: every sequence is released."""
        t0 = time.monotonic()
        V, top = self.model.cfg.vocab_size, max(1, self.max_model_len - WARM_K)
        ids = (lambda n, salt: [(salt * 7919 + i * 104729) % V for i in range(min(n, top))])
        seqs = [Sequence(seq_id=("warm-up", i), request_id="warm-up", index=0, prompt_token_ids=ids(n, i),
                         params=_GREEDY) for i, n in enumerate([100, 20] + [5] * (WARM_BATCH - 2))]
        for group in (seqs[:1], seqs[1:2], seqs):
            drafts = self.propose(group, [WARM_K] * len(group))
        for seq, d in zip(seqs[2:5], drafts[2:5]):   # a draft accepted, then the model's token: one to catch up
            seq.token_ids += [*d[:1], 0]
        mixed = seqs[2:5] + [Sequence(seq_id=("warm-up", "new"), request_id="warm-up", index=0,
                                      prompt_token_ids=ids(12, WARM_BATCH), params=_GREEDY)]
        self.propose(mixed, [WARM_K] * len(mixed))
        self.propose(seqs[2:5], [WARM_K] * 3)
        self.reset()
        self.backend.after_warm_up()
        log.info("draft model warmed up in %.1f s", time.monotonic() - t0)

    # ---- the proposer's interface ------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """For each seqs[i], up to ks[i] tokens the draft model predicts greedily to follow its token_ids
        ([] where it has no room or no token to propose)."""
        if len(seqs) != len(ks):
            raise ValueError(f"propose got {len(seqs)} sequences but {len(ks)} token counts; give one k per sequence")
        out: list[list[int]] = [[] for _ in seqs]
        work = []                                       # (index, mirror, k) of the sequences that draft
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if seq.num_tokens >= self.max_model_len:    # past the draft's context for good: its blocks go back
                self.release(seq.seq_id)
                continue
            k = min(int(k), self.max_model_len - seq.num_tokens + 1)    # drafts' positions stay in the context
            mirror = self._follow(seq) if k >= 1 else None
            if mirror is not None and self._reserve(mirror, k):
                work.append((i, mirror, k))
        if not work:
            return out
        for (i, _, _), tok in zip(work, self._catch_up([m for _, m, _ in work])):
            out[i].append(tok)
        self._draft_rest([(out[i], m, k) for i, m, k in work])
        if self.window:
            for i, m, _ in work:
                self._slide(m, seqs[i].num_tokens)
        return out

    def release(self, seq_id: Hashable) -> None:
        """The target sequence finished or was aborted: free its draft blocks and forget it (unknown: no-op)."""
        self._mirrors.pop(seq_id, None)
        self._dropped.pop(seq_id, None)
        if seq_id in self.block_manager:
            self.block_manager.free(seq_id)

    def reset(self) -> None:
        """Forget every sequence (the target engine reset its state)."""
        for seq_id in list(self._mirrors):
            self.release(seq_id)

    def num_blocks(self, seq_id: Hashable) -> int:
        """Draft KV blocks seq_id holds now (0 if none; those a sliding window gave back not counted)."""
        bm = self.block_manager
        return len(bm.block_table(seq_id)) - self._dropped.get(seq_id, 0) // bm.block_size if seq_id in bm else 0

    def computed_tokens(self, seq_id: Hashable) -> list[int]:
        """A copy of the token ids whose K/V the draft's cache holds for seq_id."""
        mirror = self._mirrors.get(seq_id)
        return mirror.token_ids[:mirror.num_computed_tokens] if mirror is not None else []

    # ---- KV bookkeeping ------------------------------------------------------------------------
    def _follow(self, seq: Sequence) -> Sequence:
        """seq's mirror, rolled back to the longest prefix its cache shares with seq.token_ids (at most all but
        the last token: that one's logits are needed) and holding seq's token ids from there on."""
        target = seq.token_ids
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq_id=seq.seq_id, request_id=str(seq.request_id), index=0, prompt_token_ids=target,
                              params=_GREEDY)
            self._mirrors[seq.seq_id] = mirror
            return mirror
        have, limit = mirror.token_ids, min(mirror.num_computed_tokens, len(target) - 1)
        common = 0
        while common < limit and have[common] == target[common]:
            common += 1
        if common - self.window + 1 < self._dropped.get(seq.seq_id, 0):    # its window's K/V went back
            self.release(seq.seq_id)
            return self._follow(seq)
        if seq.seq_id in self.block_manager:
            self.block_manager.truncate(seq.seq_id, common)
        mirror.num_computed_tokens = common
        mirror.token_ids = list(target)
        return mirror

    def _slide(self, mirror: Sequence, num_tokens: int) -> None:
        """A sliding-window draft model: give back mirror's blocks wholly before the window of position
        num_tokens - 1, as the scheduler does for the target. The target's num_tokens ids stay (only drafts
        roll back), so the next call's catch-up starts at num_tokens or later and reads nothing given back
        here; a sequence rolled back further is recomputed from its start (_follow)."""
        bs = self.block_manager.block_size
        pos = max(0, num_tokens - self.window + 1)
        self.block_manager.release_before(mirror.seq_id, pos)
        self._dropped[mirror.seq_id] = max(self._dropped.get(mirror.seq_id, 0), pos // bs * bs)

    def _reserve(self, mirror: Sequence, k: int) -> bool:
        """Blocks for mirror's uncomputed ids and the k - 1 drafts computed after them, all at once so no pass
        of this call can run out; False (nothing reserved) when the pool lacks them."""
        need = mirror.num_uncomputed_tokens + k - 1
        if self.block_manager.allocate_slots(mirror.seq_id, mirror.num_computed_tokens, need) is not None:
            return True
        log.debug("draft pool full: no proposal for sequence %r this step", mirror.seq_id)
        if mirror.seq_id not in self.block_manager:     # a first allocation that failed: nothing to follow
            del self._mirrors[mirror.seq_id]
        return False

    # ---- forward passes ------------------------------------------------------------------------
    def _catch_up(self, mirrors: list[Sequence]) -> list[int]:
        """Compute every mirror's uncomputed ids, in passes of at most the step budget and sequence cap; returns
        each mirror's first draft (the argmax after its last id), in order."""
        first: dict[int, int] = {}
        pending = list(range(len(mirrors)))
        while pending:
            batch, budget = [], self.max_tokens
            for j in pending[:self.max_seqs]:
                n = min(mirrors[j].num_uncomputed_tokens, budget)
                if n == 0:
                    break
                batch.append((j, n))
                budget -= n
            sampled = [j for j, n in batch if n == mirrors[j].num_uncomputed_tokens]
            tokens = self._run(self._catch_up_pass([(mirrors[j], n) for j, n in batch]))
            first.update(zip(sampled, tokens))
            pending = [j for j in pending if mirrors[j].num_uncomputed_tokens]
        return [first[j] for j in range(len(mirrors))]

    def _catch_up_pass(self, batch: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
        """One catch-up pass: (mirror, ids it computes). When every mirror computes all of its few uncomputed
        ids and their rows fit the decode batch, the pass is decode-shaped, as the target verifies drafts: the
        first uncomputed id is the sequence's token and the rest ride as `draft` rows, each at its own position
        over the same block table (core/step_plan.py); the fused decode kernels (and, on CUDA, the decode
        graphs) run it in the pass a chunk would take on the op-by-op path. Each row's logits are those its own
        decode step would give, so the proposals are the same either way; only the last row's are read."""
        short = all(n == m.num_uncomputed_tokens and n <= DECODE_CATCH_UP for m, n in batch)
        if short and sum(n for _, n in batch) <= self.max_seqs:
            return [ScheduledSeq(m, n, samples=True, draft=tuple(m.token_ids[m.num_computed_tokens + 1:]))
                    for m, n in batch]
        return [ScheduledSeq(m, n, samples=n == m.num_uncomputed_tokens) for m, n in batch]

    def _draft_rest(self, work: list[tuple[list[int], Sequence, int]]) -> None:
        """Decode passes: each sequence's latest draft in, its next draft out, until it holds k (drafts[i] has
        its first). A computed draft joins its mirror's ids; the last draft is only proposed."""
        while True:
            live = [(drafts, m) for drafts, m, k in work if len(drafts) < k]
            if not live:
                return
            for a in range(0, len(live), self.max_seqs):
                part = live[a:a + self.max_seqs]
                for drafts, m in part:
                    m.token_ids.append(drafts[-1])
                tokens = self._run([ScheduledSeq(m, 1, samples=True) for _, m in part])
                for (drafts, _), tok in zip(part, tokens):
                    drafts.append(tok)

    def _run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """One forward pass of the draft model over `scheduled` (blocks already reserved); advances each
        mirror's computed count; returns the argmax of each sampling sequence's last row, in batch order."""
        bm = self.block_manager
        plan = build_step_plan(scheduled, [bm.block_table(s.seq.seq_id) for s in scheduled], (), self.layout)
        result = self.runner.run(plan)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        if not plan.logits_indices.size:
            return []
        best = self.backend.argmax(result.logits)
        rows = [s.num_new_tokens if s.draft else 1 for s in scheduled if s.samples]
        ends = itertools.accumulate(rows)                  # a sequence's rows are consecutive, its last is read
        return [int(best[end - 1]) for end in ends]
