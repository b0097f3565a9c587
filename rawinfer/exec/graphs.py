"""Decode graphs: pure decode steps replayed as captured forward passes (backends with Capabilities.graphs).

A pure decode step (every scheduled sequence has exactly one new token) of B sequences runs through the
graph of the smallest bucket >= B (StepPlan.graph_bucket); buckets are 1, 2, 4, 8, ... and the largest
decode batch, min(max_num_seqs, max_num_batched_tokens).  A graph bakes in its buffers' addresses, so
its inputs live in one fixed int32 region of the pool's workspace (`decode_inputs`, requested through
`DecodeGraphs.workspace_request`), laid out per bucket:

    | token_ids B | positions B | slot_mapping B | context_lens B | logits_indices B |
    | query_start_loc B+1 | block_tables B x MB |                     (decode_layout, int32 words)

Each step packs its plan into that layout on the host (`build_decode_inputs`, a pure function),
uploads it with one copy, and replays.  Rows past the real batch are padding: token 0 at position 0,
one query, context 1, every block-table entry and the K/V slot in the pool's padding block (which the
block manager never hands out), so they compute garbage no real sequence reads.  The first rows of
logits_indices are the rows whose logits the step returns, in batch order.

Every bucket is captured at once, by the first pure decode step (the engine's warm-up runs one, so a
server has them all before its first request; without a warm-up the first request's first decode step
pays): each bucket's forward pass runs once eagerly on a step of padding rows only (compiling and
warming cuBLAS), is captured, and the real step then replays its bucket.  So no decode step after that
runs eagerly, whatever batch sizes the load later reaches.  One log line says what the graphs cost:
capture time, the pool memory they use (their inputs region and the padding KV block, both carved by
the pool: MemoryPool(padding_block=True, extra_workspace=workspace_request(...))), and, on a GPU, the
device memory the graphs themselves took beside the pool (kernel parameters and launch records; every
buffer a graph touches is in the pool, so this is small: it comes out of the 1 - gpu_memory_utilization
share of the device the pool leaves).

NOTE: a graph replays its bucket's shapes, and cuBLAS may pick another algorithm for B rows than for
the bucket's, so graph and eager logits of the same real rows agree to rounding, not bit for bit;
replaying a bucket's graph and running the same padded batch eagerly give identical bits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from rawinfer.backend.base import FlatBatch
from rawinfer.config import EngineConfig, ModelConfig
from rawinfer.core.step_plan import StepPlan
from rawinfer.exec.memory import max_blocks_per_seq
from rawinfer.exec.model import DecoderModel

REGION = "decode_inputs"     # the workspace region of the graphs' inputs

log = logging.getLogger("rawinfer")


def graph_buckets(largest: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: powers of two below `largest`, then `largest`."""
    if largest < 1:
        raise ValueError(f"the largest decode batch must be at least 1, got {largest}")
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (largest,)


def max_graph_batch(ecfg: EngineConfig) -> int:
    """The largest decode batch a graph is captured for (every decode batch fits in it)."""
    return min(ecfg.max_num_seqs, ecfg.max_num_batched_tokens)


def decode_input_words(batch: int, max_blocks: int) -> int:
    """int32 words of one padded decode step's inputs for `batch` rows: five [B] fields,
    query_start_loc [B+1] and block_tables [B, MB]."""
    return batch * (6 + max_blocks) + 1


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


def padding_decode_inputs(bucket: int, max_blocks: int, block_size: int, padding_block: int) -> np.ndarray:
    """The packed int32 host buffer [decode_input_words(bucket, MB)] of a step of padding rows only (see
    the module docstring): every row reads and writes the padding block alone."""
    buf = np.empty(decode_input_words(bucket, max_blocks), np.int32)
    f = {name: buf[words].reshape(shape) for name, (words, shape) in decode_layout(bucket, max_blocks).items()}
    f["block_tables"][...] = padding_block
    f["token_ids"][:] = 0
    f["positions"][:] = 0
    f["slot_mapping"][:] = padding_block * block_size         # row 0 of the padding block
    f["context_lens"][:] = 1
    f["query_start_loc"][:] = np.arange(bucket + 1, dtype=np.int32)
    f["logits_indices"][:] = np.arange(bucket, dtype=np.int32)
    return buf


def build_decode_inputs(token_ids: Sequence[int], positions: Sequence[int], slot_mapping: Sequence[int],
                        block_tables: Sequence[Sequence[int]], logits_rows: Sequence[int], bucket: int,
                        max_blocks: int, block_size: int, padding_block: int) -> np.ndarray:
    """The packed int32 host buffer [decode_input_words(bucket, MB)] of one decode step of B <= bucket
    sequences: row b < B is the new token token_ids[b] at positions[b], written to slot_mapping[b], of a
    sequence with block table block_tables[b]; rows B ... bucket-1 are padding (see the module
    docstring); logits_indices starts with logits_rows (the rows that need logits, in order) and
    continues with the remaining row numbers."""
    B = len(token_ids)
    if not 0 < B <= bucket or len(positions) != B or len(slot_mapping) != B or len(block_tables) != B:
        raise ValueError(f"decode inputs: {B} token ids, {len(positions)} positions, {len(slot_mapping)} slots "
                         f"and {len(block_tables)} block tables for a bucket of {bucket} rows")
    if len(logits_rows) > bucket:
        raise ValueError(f"decode inputs: {len(logits_rows)} logits rows for a bucket of {bucket} rows")
    buf = padding_decode_inputs(bucket, max_blocks, block_size, padding_block)
    f = {name: buf[words].reshape(shape) for name, (words, shape) in decode_layout(bucket, max_blocks).items()}
    pos = np.asarray(positions, np.int32)
    tables = f["block_tables"]
    for b, table in enumerate(block_tables):
        if len(table) > max_blocks:
            raise ValueError(f"decode inputs: row {b} owns {len(table)} blocks, more than the {max_blocks} a "
                             "sequence may own")
        tables[b, :len(table)] = table
    f["token_ids"][:B] = token_ids
    f["positions"][:B] = pos
    f["slot_mapping"][:B] = slot_mapping
    f["context_lens"][:B] = pos + 1
    f["logits_indices"][:len(logits_rows)] = logits_rows
    return buf


@dataclass
class BucketGraph:
    """One bucket's captured forward pass and the logits rows it writes."""
    graph: Any        # the backend's captured graph: replay()
    logits: Any       # [bucket, V] float32, the workspace view the graph writes


class DecodeGraphs:
    """One lazily captured forward-pass graph per batch-size bucket, over the pool's decode_inputs region."""

    @staticmethod
    def workspace_request(ecfg: EngineConfig, max_blocks: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The workspace region the graphs need, for MemoryPool(extra_workspace=...)."""
        return {REGION: ((decode_input_words(max_graph_batch(ecfg), max_blocks),), np.int32)}

    @staticmethod
    def pool_options(cfg: ModelConfig, ecfg: EngineConfig, backend) -> tuple[bool, dict]:
        """(whether the model's decode steps run in graphs, the workspace they need): MemoryPool's padding_block
        and extra_workspace for a model on `backend`."""
        if not (ecfg.use_cuda_graphs and backend.capabilities.graphs):
            return False, {}
        return True, DecodeGraphs.workspace_request(ecfg, max_blocks_per_seq(cfg, ecfg))

    def __init__(self, model: DecoderModel):
        pool = model.pool
        if pool.kv.padding_block is None:
            raise ValueError("decode graphs need the pool's padding block: build the pool with padding_block=True")
        self.model, self.backend = model, model.backend
        self.buckets = graph_buckets(max_graph_batch(pool.ecfg))
        self.max_blocks = pool.max_blocks_per_seq
        self.max_context_len = pool.max_context_len
        self.block_size = pool.kv.block_size
        self.padding_block = pool.kv.padding_block
        self.region = pool.workspace.extra[REGION]          # int32 [decode_input_words(largest bucket, MB)]
        kv = pool.kv
        # what the graphs hold in the pool: their inputs and the padding block of every layer's K and V
        self.pool_bytes = int(self.region.nbytes) + sum(int(c[kv.padding_block].nbytes) for c in kv.k + kv.v)
        self.device_bytes: int | None = None   # device memory the captures took beside the pool (GPU only)
        self.capture_seconds = 0.0
        self._graphs: dict[int, BucketGraph] = {}

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def run(self, plan: StepPlan):
        """Upload the plan's inputs and replay its bucket's graph (the first call captures every bucket
        first); logits [S, V] of plan.logits_indices, in order."""
        bucket = plan.graph_bucket
        if bucket is None or plan.score_rows.size:
            raise ValueError("only a pure decode step with a graph bucket replays a decode graph")
        if len(self._graphs) < len(self.buckets):
            self.capture_all()
        host = build_decode_inputs(plan.token_ids, plan.positions, plan.slot_mapping, plan.block_tables,
                                   plan.logits_indices, bucket, self.max_blocks, self.block_size,
                                   self.padding_block)
        self.backend.upload(self.region[:host.size], host)
        graph = self.graph_for(bucket)
        graph.graph.replay()
        return graph.logits[:plan.logits_indices.shape[0]]

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

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, each on a step of padding rows only (which writes nothing
        but the padding block and the workspace), and log what the graphs cost."""
        missing = [b for b in self.buckets if b not in self._graphs]
        if not missing:
            return
        t0 = time.perf_counter()
        free_before = self._free_device_bytes()
        try:
            for bucket in missing:
                host = padding_decode_inputs(bucket, self.max_blocks, self.block_size, self.padding_block)
                self.backend.upload(self.region[:host.size], host)
                self.graph_for(bucket)
        except (MemoryError, RuntimeError) as e:
            if not isinstance(e, MemoryError) and "out of memory" not in str(e).lower():
                raise
            raise RuntimeError(f"capturing the decode graph of {bucket} rows ran out of device memory beside the "
                               f"pool ({e}); lower --gpu-memory-utilization, or run with --no-cuda-graphs") from e
        self.backend.synchronize()
        free_after = self._free_device_bytes()
        if free_before is not None and free_after is not None:
            self.device_bytes = (self.device_bytes or 0) + max(0, free_before - free_after)
        self.capture_seconds += time.perf_counter() - t0
        log.info(self.describe())

    def describe(self) -> str:
        """One line: the buckets captured, the time it took and the memory the graphs use."""
        mib = 1024**2
        outside = (f"; {self.device_bytes / mib:.1f} MiB of device memory beside the pool"
                   if self.device_bytes is not None else "")
        return (f"decode graphs: batch sizes {', '.join(map(str, self.captured)) or 'none'} captured in "
                f"{self.capture_seconds:.2f} s; {self.pool_bytes / mib:.2f} MiB in the pool (inputs and the "
                f"padding KV block){outside}")

    def _free_device_bytes(self) -> int | None:
        if not self.backend.capabilities.on_gpu:
            return None
        self.backend.synchronize()
        return self.backend.device_memory_info()[0]
