"""A fake transformer for driving the real core from Python: it keeps a KV store of int64
"activations" laid out in blocks exactly like the engine's KV tensors, runs the step's swap/copy
plans on it, keeps the persistent batch's block table as a runner does (``BlockTable``), writes
each token's KV through the slots derived from it and reads every row's context through its
pages. KV at position p is a hash of the KV at p-1 and the token at p, and the sampled
token is derived from the last KV, so any wrong block, slot or plan changes the output, just as
it would corrupt a real model's generation.
"""

from __future__ import annotations

import numpy as np

from ferryman import RequestParams, Scheduler, SchedulerOutput
from ferryman.worker.block_table import BlockTable

MASK = (1 << 61) - 1


def mix(prev: int, token: int, pos: int) -> int:
    return ((prev * 0x9E3779B1 + token * 0x85EBCA77 + pos * 0xC2B2AE3D + 12345) ^ (prev >> 17)) & MASK


class FakeModel:
    def __init__(
        self, block_size: int, num_device_blocks: int, num_host_blocks: int, vocab: int = 50
    ) -> None:
        self.bs = block_size
        self.device = np.zeros((num_device_blocks + 1, block_size), dtype=np.int64)
        self.host = np.zeros((num_host_blocks + 1, block_size), dtype=np.int64)
        self.vocab = vocab
        self.tables = BlockTable(8, 8, block_size)  # grows to what the scheduler sends

    def forward(self, out: SchedulerOutput) -> np.ndarray:
        """Runs one step and returns one sampled token per entry of ``logits_indices``."""
        so, si, cp = out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy
        if len(so):
            self.host[so[:, 1]] = self.device[so[:, 0]]
        if len(si):
            self.device[si[:, 1]] = self.host[si[:, 0]]
        if len(cp):
            self.device[cp[:, 1]] = self.device[cp[:, 0]]
        flat = self.device.reshape(-1)
        last_kv = np.zeros(len(out.input_ids), dtype=np.int64)
        step = self.tables.step(out)
        qo, kvp, kvi = out.qo_indptr, out.kv_indptr, step.kv_indices
        for b in range(len(out.req_ids)):
            table = kvi[kvp[b] : kvp[b + 1]]
            for i in range(qo[b], qo[b + 1]):
                pos = int(step.positions[i])
                if pos == 0:
                    prev = 7
                else:
                    prev = int(flat[int(table[(pos - 1) // self.bs]) * self.bs + (pos - 1) % self.bs])
                kv = mix(prev, int(out.input_ids[i]), pos)
                flat[step.slot_mapping[i]] = kv
                last_kv[i] = kv
        rows = last_kv[out.logits_indices]
        seqs = out.sample_seq_indices.astype(np.int64)
        return ((rows + seqs * 7919) % self.vocab + 1).astype(np.int32)


def run_to_completion(
    s: Scheduler,
    model: FakeModel,
    arrivals: dict[int, list[tuple[int, list[int], int, dict[str, int]]]] | None = None,
    max_steps: int = 100_000,
    check_every_step: bool = True,
) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], str], list[SchedulerOutput]]:
    """Steps until every request finished. ``arrivals`` maps a step to requests added before it.
    Returns each (req_id, seq_index)'s generated tokens and finish reason, and the outputs."""
    arrivals = arrivals or {}
    tokens: dict[tuple[int, int], list[int]] = {}
    reasons: dict[tuple[int, int], str] = {}
    outs = []
    step = 0
    last_arrival = max(arrivals, default=-1)
    while s.has_unfinished_requests() or step <= last_arrival:
        for req_id, prompt, max_tokens, kw in arrivals.get(step, []):
            s.add_request(req_id, prompt, RequestParams(max_tokens, **kw))
        out = s.schedule()
        if check_every_step:
            s.check_invariants()
        sampled = model.forward(out)
        res = s.update(sampled)
        if check_every_step:
            s.check_invariants()
        for r, k, t, f in zip(
            res.req_ids, res.seq_indices, res.new_token_ids, res.finish_reasons, strict=True
        ):
            tokens.setdefault((int(r), int(k)), []).append(int(t))
            if f is not None:
                reasons[(int(r), int(k))] = f
        outs.append(out)
        step += 1
        assert step < max_steps, "no progress"
    return tokens, reasons, outs
