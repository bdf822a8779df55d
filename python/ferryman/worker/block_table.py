"""The runner's half of the persistent batch: the block table ``[max_num_seqs,
max_blocks_per_seq]`` int32 indexed by batch row, kept from each step's changes (the core sends
only the entries the runner does not hold: ``table_rows``, ``table_cols``, ``table_blocks``), and
the per-token arrays a step derives from it: ``positions``, ``slot_mapping`` and FlashInfer's
``kv_indices``. The derivation is vectorized numpy over the scheduled rows (no Python loop), so
the core no longer lays out every row's whole table each step.

The table lives in host memory, never copied to the device itself: the arrays derived from it are
new ones every step (staged in page-locked memory of their own when they go to a GPU); a row
freed and taken again is overwritten entry by entry before it is read, since the core sends a
taken row its whole table.

Invariant: after ``step(out)``, row ``out.rows[b]`` holds the first ``ceil(seq_lens[b] /
block_size)`` blocks of the sequence scheduled in row b.
"""

from __future__ import annotations

import numpy as np

from ferryman._core import SchedulerOutput
from ferryman.attention.base import StepInputs


class BlockTable:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self._alloc(max_num_seqs, max_blocks_per_seq)

    def _alloc(self, rows: int, cols: int) -> None:
        old, self.table = getattr(self, "table", None), np.zeros((rows, cols), dtype=np.int32)
        if old is not None:
            self.table[: old.shape[0], : old.shape[1]] = old

    def step(self, out: SchedulerOutput) -> StepInputs:
        """Applies the step's table changes, then derives its per-token arrays."""
        if len(out.table_rows):
            need = (int(out.table_rows.max()) + 1, int(out.table_cols.max()) + 1)
            if (
                need[0] > self.table.shape[0] or need[1] > self.table.shape[1]
            ):  # a scheduler sized beyond ours
                self._alloc(max(need[0], self.table.shape[0]), max(need[1], self.table.shape[1]))
            self.table[out.table_rows, out.table_cols] = out.table_blocks
        bs, cols = self.block_size, self.table.shape[1]
        flat = self.table.ravel()  # flat takes: 0.4-0.5 of 2-D indexing's time (benchmarks/block_table.py)
        rows, seq_lens, qo, kvp = out.rows, out.seq_lens, out.qo_indptr, out.kv_indptr
        lens = seq_lens.astype(np.int64)
        base = rows.astype(np.int64) * cols  # each row's first entry in `flat`
        b, t, nnz = len(rows), int(qo[-1]), int(kvp[-1])
        if t == b:  # decode only: one token per row, at its last position
            tok_base, positions = base, lens - 1
        else:
            tok = np.repeat(np.arange(b), np.diff(qo))
            tok_base = base[tok]
            positions = lens[tok] - (qo[tok + 1] - np.arange(t))
        slots = flat.take(tok_base + positions // bs).astype(np.int64) * bs + positions % bs
        # each row's first pages, row after row: entry j of row i is at base[i] + j
        kv_indices = flat.take(np.repeat(base - kvp[:-1], np.diff(kvp)) + np.arange(nnz))
        return StepInputs(
            out.input_ids, positions, slots, qo, seq_lens, kvp, kv_indices, out.kv_last_page_len
        )
