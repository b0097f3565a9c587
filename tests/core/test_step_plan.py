"""The step plan: the flat host arrays one forward pass runs on, built from the scheduler's decision."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.core.sequence import Sequence
from rawinfer.core.step_plan import (PlanLayout, ScheduledSeq, _chunk_arrays, _decode_arrays, bucket_for,
                                     build_step_plan, slot_mapping)
from rawinfer.sampling import SamplingParams


def make_seq(sid: str, prompt: list[int], out: list[int], computed: int, chunk_sizes=None) -> Sequence:
    seq = Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=prompt, params=SamplingParams(),
                   chunk_sizes=chunk_sizes)
    for t in out:
        seq.append_token(t, 0.0)
    seq.num_computed_tokens = computed
    return seq


def test_a_sequence_keeps_one_token_list():
    seq = make_seq("s", [5, 6, 7], [8, 9], 0)
    assert seq.token_ids == [5, 6, 7, 8, 9] and seq.num_tokens == 5
    assert (seq.num_prompt_tokens, seq.num_output_tokens) == (3, 2)
    assert seq.prompt_token_ids == [5, 6, 7] and seq.output_token_ids == [8, 9]
    seq.prompt_token_ids.append(1)                # copies: the sequence's own list is untouched
    seq.output_token_ids.append(1)
    assert seq.token_ids == [5, 6, 7, 8, 9] and not seq.is_finished


def test_slot_mapping_on_ints_and_arrays():
    table = [7, 3, 12]
    assert [slot_mapping(table, p, 4) for p in (0, 3, 4, 9)] == [28, 31, 12, 49]
    np.testing.assert_array_equal(slot_mapping(np.array(table), np.arange(12), 4),
                                  [28, 29, 30, 31, 12, 13, 14, 15, 48, 49, 50, 51])


def test_decode_fast_path_equals_the_chunk_path():
    """A pure decode step's arrays built by the scalar fast path equal the general path's, field by field
    (tables of different lengths, a position on a block boundary, a row that needs no logits)."""
    tables = [[7, 3], [1], [4, 9, 2]]
    scheduled = [ScheduledSeq(make_seq("a", [1, 2, 3, 4, 5], [6], 5), 1, samples=True),
                 ScheduledSeq(make_seq("b", [8, 9], [10], 2), 1, samples=True),
                 # c: one new token, two more known: no logits this step
                 ScheduledSeq(make_seq("c", list(range(20, 28)), [30, 31, 32], 8), 1, samples=False)]
    layout = PlanLayout(block_size=4, pad_block=0)
    fast, slow = _decode_arrays(scheduled, tables, layout), _chunk_arrays(scheduled, tables, layout)
    assert fast.keys() == slow.keys()
    for name in fast:
        np.testing.assert_array_equal(fast[name], slow[name], err_msg=name)
        assert fast[name].dtype == slow[name].dtype == np.int32, name
    assert fast["token_ids"].tolist() == [6, 10, 30]
    assert fast["slot_mapping"].tolist() == [3 * 4 + 1, 1 * 4 + 2, 2 * 4 + 0]
    assert fast["logits_indices"].tolist() == [0, 1]
    plan = build_step_plan(scheduled, tables, [], layout)
    assert (plan.num_tokens, plan.num_seqs, plan.max_query_len, plan.max_context_len) == (3, 3, 1, 9)


def test_draft_rows_are_decode_rows_on_both_paths():
    """A sequence verifying k drafts is k + 1 one-row queries over its table (positions p .. p + k, contexts
    p + 1 .. p + k + 1, every row with logits), in a pure decode step and beside a prefill chunk alike."""
    tables = [[7, 3], [1]]
    a = ScheduledSeq(make_seq("a", [1, 2, 3, 4, 5], [6], 5), 3, samples=True, draft=(40, 41))
    b = ScheduledSeq(make_seq("b", [8, 9], [10], 2), 1, samples=True)
    layout = PlanLayout(block_size=4, pad_block=0)
    fast, slow = _decode_arrays([a, b], tables, layout), _chunk_arrays([a, b], tables, layout)
    for name in fast:
        np.testing.assert_array_equal(fast[name], slow[name], err_msg=name)
    assert fast["token_ids"].tolist() == [6, 40, 41, 10] and fast["positions"].tolist() == [5, 6, 7, 2]
    assert fast["context_lens"].tolist() == [6, 7, 8, 3] and fast["logits_indices"].tolist() == [0, 1, 2, 3]
    assert fast["slot_mapping"].tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 2]
    assert fast["block_tables"].tolist() == [[7, 3], [7, 3], [7, 3], [1, 0]]
    plan = build_step_plan([a, b], tables, [], PlanLayout(4, graph_buckets=(1, 2, 4, 8)))
    assert plan.graph_bucket == 4 and plan.max_query_len == 1 and plan.num_seqs == 4
    c = ScheduledSeq(make_seq("c", list(range(50, 60)), [], 0), 6, samples=False)      # a prefill chunk
    mixed = build_step_plan([a, c], [[7, 3], [8, 9]], [], layout)
    assert mixed.query_start_loc.tolist() == [0, 1, 2, 3, 9] and mixed.logits_indices.tolist() == [0, 1, 2]
    assert mixed.context_lens.tolist() == [6, 7, 8, 6] and mixed.max_query_len == 6


def test_mixed_step_rows_logits_and_padding():
    a = ScheduledSeq(make_seq("a", list(range(10)), [], 4), 6, samples=True)            # prompt's last chunk
    b = ScheduledSeq(make_seq("b", [1, 2, 3], [4], 3), 1, samples=True)                # decode
    c = ScheduledSeq(make_seq("c", list(range(50, 70)), [], 0), 8, samples=False)      # a prefill chunk
    plan = build_step_plan([a, b, c], [[5, 6, 7], [2], [8, 9]], [(1, 2)], PlanLayout(4, pad_block=99))
    assert plan.token_ids.tolist() == [4, 5, 6, 7, 8, 9, 4] + list(range(50, 58))
    assert plan.positions.tolist() == [4, 5, 6, 7, 8, 9, 3] + list(range(8))
    assert plan.query_start_loc.tolist() == [0, 6, 7, 15] and plan.context_lens.tolist() == [10, 4, 8]
    assert plan.logits_indices.tolist() == [5, 6] and plan.score_rows.size == 0
    assert plan.block_tables.tolist() == [[5, 6, 7], [2, 99, 99], [8, 9, 99]]
    assert plan.copies == ((1, 2),) and plan.max_query_len == 8 and plan.graph_bucket is None
    assert plan.slot_mapping[:6].tolist() == [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]


def test_scoring_rows_and_graph_buckets():
    layout = PlanLayout(4, graph_buckets=(1, 2, 4))
    s = ScheduledSeq(make_seq("s", list(range(12)), [], 4, chunk_sizes=(4, 5, 3)), 5, samples=False)
    d = ScheduledSeq(make_seq("d", [1, 2], [3], 2), 1, samples=True)
    plan = build_step_plan([d, s], [[0], [1, 2, 3]], [], layout)
    assert plan.score_rows.tolist() == [1, 2, 3, 4, 5] and plan.logits_indices.tolist() == [0]
    assert plan.graph_bucket is None                           # scoring rows never replay a decode graph
    decode = [ScheduledSeq(make_seq(f"x{i}", [1, 2], [3], 2), 1, samples=True) for i in range(3)]
    assert build_step_plan(decode, [[i] for i in range(3)], [], layout).graph_bucket == 4
    assert build_step_plan(decode[:1], [[0]], [], layout).graph_bucket == 1
    five = decode + decode[:2]
    assert build_step_plan(five, [[i] for i in range(5)], [], layout).graph_bucket is None   # past the largest
    assert build_step_plan(decode, [[i] for i in range(3)], [], PlanLayout(4)).graph_bucket is None
    with pytest.raises(ValueError, match="at least one"):
        build_step_plan([], [], [], layout)


def test_bucket_for_names_the_largest_bucket():
    assert bucket_for(3, (1, 2, 4)) == 4
    with pytest.raises(ValueError, match="largest 4"):
        bucket_for(5, (1, 2, 4))
