"""ModelRunner: a ScheduledBatch -> flat token batch (positions, slot mapping, block tables) -> logits,
run eagerly or, for decode steps on CUDA, as a replayed CUDA graph.

Decode graphs (CUDA only; `EngineConfig.use_cuda_graphs`, `--no-cuda-graphs` turns them off).  A
pure decode step (every scheduled sequence has exactly one new token) of B sequences runs through the
graph of the smallest bucket >= B; buckets are 1, 2, 4, 8, ... and the largest decode batch,
min(max_num_seqs, max_num_batched_tokens).  A graph bakes in its buffers' addresses, so its inputs
live in one fixed int32 region of the pool (workspace.decode_inputs), laid out per bucket:

    | token_ids B | positions B | slot_mapping B | context_lens B | logits_indices B |
    | query_start_loc B+1 | block_tables B x MB |                     (decode_layout, int32 words)

Each step builds that buffer on the host (`build_decode_inputs`, a pure function) and uploads it with
one copy, then replays.  Rows past the real batch are padding: token 0 at position 0, one query,
context 1, every block-table entry and the K/V slot in the pool's padding block (which the block
manager never hands out), so they compute garbage no real sequence reads.  The first rows of
logits_indices are the rows whose logits the step returns, in batch order.

Graphs are captured lazily: the first decode step that needs bucket b runs the forward pass once
eagerly (compiling and warming cuBLAS), captures it, and replays it; later steps only replay.  Start-up
stays as fast as without graphs, and only the buckets a workload reaches cost capture time.  Prefill,
chunked prefill and mixed steps, and teacher-forced scoring, always run eagerly.

NOTE: a graph replays its bucket's shapes, and cuBLAS may pick another algorithm for B rows than for
the bucket's, so graph and eager logits of the same real rows agree to rounding, not bit for bit;
replaying a bucket's graph and running the same padded batch eagerly give identical bits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from rawinfer.core.block_manager import BlockManager
from rawinfer.exec.memory import decode_input_words, max_graph_batch
from rawinfer.exec.model import FlatBatch, LlamaModel
from rawinfer.core.scheduler import ScheduledBatch


# ---- decode-graph inputs (pure host functions) ------------------------------------------------------
def graph_buckets(largest: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: powers of two below `largest`, then `largest`."""
    if largest < 1:
        raise ValueError(f"the largest decode batch must be at least 1, got {largest}")
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (largest,)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `batch` rows."""
    i = bisect.bisect_left(buckets, batch)
    if batch < 1 or i == len(buckets):
        raise ValueError(f"a decode batch of {batch} sequences fits no graph bucket (largest {buckets[-1]})")
    return buckets[i]


def decode_layout(bucket: int, max_blocks: int) -> dict[str, tuple[slice, tuple[int, ...]]]:
    """Field -> (words of the packed int32 buffer, shape) of one bucket's decode inputs."""
    shapes = {"token_ids": (bucket,), "positions": (bucket,), "slot_mapping": (bucket,),
              "context_lens": (bucket,), "logits_indices": (bucket,), "query_start_loc": (bucket + 1,),
              "block_tables": (bucket, max_blocks)}
    layout, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        layout[name] = (slice(offset, offset + n), shape)
        offset += n
    assert offset == decode_input_words(bucket, max_blocks)
    return layout


def build_decode_inputs(token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
                        logits_rows: Sequence[int], bucket: int, max_blocks: int, block_size: int,
                        padding_block: int) -> np.ndarray:
    """The packed int32 host buffer [decode_input_words(bucket, MB)] of one decode step of B <= bucket
    sequences: row b < B is the new token token_ids[b] at positions[b] of a sequence with block table
    block_tables[b]; rows B ... bucket-1 are padding (see the module docstring); logits_indices starts
    with logits_rows (the rows that need logits, in order) and continues with the remaining row numbers."""
    B = len(token_ids)
    if not 0 < B <= bucket or len(positions) != B or len(block_tables) != B:
        raise ValueError(f"decode inputs: {B} token ids, {len(positions)} positions and {len(block_tables)} "
                         f"block tables for a bucket of {bucket} rows")
    if len(logits_rows) > bucket:
        raise ValueError(f"decode inputs: {len(logits_rows)} logits rows for a bucket of {bucket} rows")
    buf = np.empty(decode_input_words(bucket, max_blocks), np.int32)
    f = {name: buf[words].reshape(shape) for name, (words, shape) in decode_layout(bucket, max_blocks).items()}
    pos = np.asarray(positions, np.int32)
    tables = f["block_tables"]
    tables[...] = padding_block
    for b, table in enumerate(block_tables):
        if len(table) > max_blocks:
            raise ValueError(f"decode inputs: row {b} owns {len(table)} blocks, more than the {max_blocks} a "
                             "sequence may own")
        tables[b, :len(table)] = table
    f["token_ids"][:B] = token_ids
    f["token_ids"][B:] = 0
    f["positions"][:B] = pos
    f["positions"][B:] = 0
    f["slot_mapping"][:B] = tables[np.arange(B), pos // block_size] * block_size + pos % block_size
    f["slot_mapping"][B:] = padding_block * block_size
    f["context_lens"][:B] = pos + 1
    f["context_lens"][B:] = 1
    f["query_start_loc"][:] = np.arange(bucket + 1, dtype=np.int32)
    f["logits_indices"][:] = np.arange(bucket, dtype=np.int32)
    f["logits_indices"][:len(logits_rows)] = logits_rows
    return buf


# ---- captured decode graphs -------------------------------------------------------------------------
@dataclass
class BucketGraph:
    """One bucket's captured forward pass and the logits rows it writes."""
    graph: Any        # the backend's captured graph: replay()
    logits: Any       # [bucket, V] float32, the workspace view the graph writes


class DecodeGraphs:
    """One lazily captured forward-pass graph per batch-size bucket, over the pool's decode_inputs."""

    def __init__(self, model: LlamaModel):
        pool = model.pool
        self.model, self.backend = model, model.backend
        self.buckets = graph_buckets(max_graph_batch(pool.ecfg))
        self.max_blocks = pool.max_blocks_per_seq
        self.max_context_len = pool.max_context_len
        self.block_size = pool.kv.block_size
        self.padding_block = pool.kv.padding_block
        self.region = pool.workspace.decode_inputs           # int32 [decode_input_words(largest bucket, MB)]
        self._graphs: dict[int, BucketGraph] = {}

    def accepts(self, batch: ScheduledBatch) -> bool:
        """A pure decode step that fits the largest bucket."""
        return 0 < len(batch.seqs) <= self.buckets[-1] and all(s.num_new_tokens == 1 for s in batch.seqs)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def run(self, batch: ScheduledBatch, block_manager: BlockManager):
        """Upload the step's inputs, replay (capturing first if needed); logits [S, V] in batch order."""
        token_ids, positions, tables, logits_rows = [], [], [], []
        for row, s in enumerate(batch.seqs):
            seq = s.seq
            pos = seq.num_computed_tokens
            token_ids.extend(seq.token_ids_between(pos, pos + 1))
            positions.append(pos)
            tables.append(block_manager.block_table(seq.seq_id))
            if s.needs_logits:
                logits_rows.append(row)
        bucket = bucket_for(len(batch.seqs), self.buckets)
        host = build_decode_inputs(token_ids, positions, tables, logits_rows, bucket, self.max_blocks,
                                   self.block_size, self.padding_block)
        self.backend.upload(self.region[:host.size], host)
        graph = self.graph_for(bucket)
        graph.graph.replay()
        return graph.logits[:len(logits_rows)]

    def flat_batch(self, bucket: int) -> FlatBatch:
        """The forward pass's inputs for `bucket` rows: views of the region, read by that bucket's graph."""
        views = {name: self.region[words].reshape(shape)
                 for name, (words, shape) in decode_layout(bucket, self.max_blocks).items()}
        return FlatBatch(**views, num_tokens=bucket, max_query_len=1, max_context_len=self.max_context_len)

    def graph_for(self, bucket: int) -> BucketGraph:
        """The bucket's graph, captured now if this is its first use (the region must hold valid inputs
        for `bucket` rows: the capture runs the forward pass once for real)."""
        if bucket not in self._graphs:
            flat = self.flat_batch(bucket)
            written = []
            graph = self.backend.capture_graph(lambda: written.append(self.model.forward(flat)))
            self._graphs[bucket] = BucketGraph(graph, written[0])
        return self._graphs[bucket]


# ---- the runner -------------------------------------------------------------------------------------
class ModelRunner:
    def __init__(self, model: LlamaModel, block_manager: BlockManager):
        self.model = model
        self.backend = model.backend
        self.bm = block_manager
        self.block_size = block_manager.block_size
        ws = model.pool.workspace
        if ws.attention is not None:   # decode attention's split-K scratch: a pool carve, no allocations
            self.backend.bind_attention_workspace(ws.attention)
        self.graphs = DecodeGraphs(model) if model.pool.uses_cuda_graphs else None
        self.use_graphs = self.graphs is not None   # benchmarks may switch graphs off to compare

    def prepare(self, batch: ScheduledBatch, all_logits: bool = False) -> FlatBatch:
        """Flatten the scheduled chunks. Logits rows: each sequence's last token when its chunk reaches
        the end of its known tokens (or every row when all_logits, for teacher-forced scoring)."""
        tables = [self.bm.block_table(s.seq.seq_id) for s in batch.seqs]
        if batch.seqs and not all_logits and all(s.num_new_tokens == 1 for s in batch.seqs):
            return self._prepare_decode(batch, tables)
        return self._prepare_chunks(batch, tables, all_logits)

    @staticmethod
    def _zero_block_tables(tables: list[list[int]]) -> np.ndarray:
        """int32 [B, longest table] of zeros, for the rows' tables to be copied in."""
        return np.zeros((len(tables), max((len(t) for t in tables), default=1) or 1), np.int32)

    def _prepare_chunks(self, batch: ScheduledBatch, tables: list[list[int]], all_logits: bool) -> FlatBatch:
        """prepare() for any batch (prefill chunks, mixed steps)."""
        BS = self.block_size
        B = len(batch.seqs)
        block_tables = self._zero_block_tables(tables)
        ids, positions, slots, logits_idx = [], [], [], []
        context_lens = np.zeros(B, np.int32)
        qsl = np.zeros(B + 1, np.int32)
        row = 0
        for b, (s, table) in enumerate(zip(batch.seqs, tables)):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n, dtype=np.int32)
            tab = np.asarray(table, np.int32)
            block_tables[b, :len(tab)] = tab
            ids.append(np.asarray(seq.token_ids_between(start, start + n), np.int32))
            positions.append(pos)
            slots.append(tab[pos // BS] * BS + pos % BS)
            context_lens[b] = start + n
            qsl[b + 1] = qsl[b] + n
            if all_logits:
                logits_idx.extend(range(row, row + n))
            elif s.needs_logits:
                logits_idx.append(row + n - 1)
            row += n
        be = self.backend
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int32))
        return FlatBatch(
            token_ids=be.as_index_array(cat(ids)),
            positions=be.as_index_array(cat(positions)),
            slot_mapping=be.as_index_array(cat(slots)),
            block_tables=be.as_index_array(block_tables),
            context_lens=be.as_index_array(context_lens),
            query_start_loc=be.as_index_array(qsl),
            logits_indices=be.as_index_array(np.asarray(logits_idx, np.int32)),
            num_tokens=row,
            max_query_len=int(max((s.num_new_tokens for s in batch.seqs), default=0)),
            max_context_len=int(context_lens.max()) if B else 0,
        )

    def _prepare_decode(self, batch: ScheduledBatch, tables: list[list[int]]) -> FlatBatch:
        """prepare() for a pure decode step (one new token per sequence) in scalar Python, without the
        general path's per-sequence arrays: 0.3 vs 1.4 ms for 64 sequences."""
        BS = self.block_size
        B = len(batch.seqs)
        block_tables = self._zero_block_tables(tables)
        ids, positions, slots, logits_idx = [0] * B, [0] * B, [0] * B, []
        for b, (s, table) in enumerate(zip(batch.seqs, tables)):
            seq = s.seq
            pos = seq.num_computed_tokens
            ids[b] = seq.token_ids_between(pos, pos + 1)[0]
            positions[b] = pos
            slots[b] = table[pos // BS] * BS + pos % BS
            block_tables[b, :len(table)] = table
            if s.needs_logits:
                logits_idx.append(b)
        pos = np.asarray(positions, np.int32)
        be = self.backend
        return FlatBatch(
            token_ids=be.as_index_array(np.asarray(ids, np.int32)),
            positions=be.as_index_array(pos),
            slot_mapping=be.as_index_array(np.asarray(slots, np.int32)),
            block_tables=be.as_index_array(block_tables),
            context_lens=be.as_index_array(pos + 1),
            query_start_loc=be.as_index_array(np.arange(B + 1, dtype=np.int32)),
            logits_indices=be.as_index_array(np.asarray(logits_idx, np.int32)),
            num_tokens=B,
            max_query_len=1,
            max_context_len=int(pos.max()) + 1,
        )

    def run(self, batch: ScheduledBatch):
        """Copy-on-write copies, then the forward pass (a decode graph where one applies). Returns
        device logits [S, V] in batch order."""
        if batch.copies:
            kv = self.model.pool.kv
            self.backend.copy_blocks(kv.k, kv.v, batch.copies)
        if self.use_graphs and self.graphs is not None and self.graphs.accepts(batch):
            return self.graphs.run(batch, self.bm)
        return self.model.forward(self.prepare(batch))

    def score(self, batch: ScheduledBatch) -> np.ndarray:
        """Teacher forcing: host logits [T, V] float32 at every row, the LM head run in workspace-sized pieces."""
        fb = self.prepare(batch, all_logits=True)
        self.model.forward_hidden(fb)
        rows = self.model.pool.logits_rows
        out = np.empty((fb.num_tokens, self.model.cfg.vocab_size), np.float32)
        for a in range(0, fb.num_tokens, rows):
            idx = self.backend.as_index_array(np.arange(a, min(a + rows, fb.num_tokens), dtype=np.int32))
            out[a:a + len(idx)] = self.backend.to_host(self.model.compute_logits(idx))
        return out
