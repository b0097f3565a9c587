"""ModelRunner: a ScheduledBatch -> flat token batch (positions, slot mapping, block tables) -> logits."""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager
from .model import FlatBatch, LlamaModel
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, block_manager: BlockManager):
        self.model = model
        self.backend = model.backend
        self.bm = block_manager
        self.block_size = block_manager.block_size

    def prepare(self, batch: ScheduledBatch, all_logits: bool = False) -> FlatBatch:
        """Flatten the scheduled chunks. Logits rows: each sequence's last token when its chunk reaches
        the end of its known tokens (or every row when all_logits, for teacher-forced scoring)."""
        BS = self.block_size
        B = len(batch.seqs)
        tables = [self.bm.block_table(s.seq.seq_id) for s in batch.seqs]
        MB = max((len(t) for t in tables), default=1) or 1
        block_tables = np.zeros((B, MB), np.int32)
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
            ids.append(np.asarray(seq.all_token_ids[start:start + n], np.int32))
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

    def run(self, batch: ScheduledBatch):
        """Copy-on-write copies, then the forward pass. Returns device logits [S, V] in batch order."""
        if batch.copies:
            kv = self.model.pool.kv
            self.backend.copy_blocks(kv.k, kv.v, batch.copies)
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
