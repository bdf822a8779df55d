"""ModelRunner: one step's tensors in, logits of the rows to sample out.

Order within a step: the swap/copy plans, then the attention plan, then the forward, then the
logits of ``logits_indices`` (a row repeats for n > 1)."""

from __future__ import annotations

import torch

from ferryman._core import SchedulerOutput
from ferryman.attention import TorchAttentionBackend
from ferryman.models.llama import LlamaForCausalLM
from ferryman.worker.kv_cache import KvCache


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KvCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.attn = TorchAttentionBackend(kv.device_kv, block_size, scale=model.cfg.head_dim**-0.5)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits ``[S, vocab]``, S = len(out.logits_indices)."""
        self.kv.run_plans(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        if out.num_scheduled_tokens == 0:
            return torch.empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        self.attn.plan(out)
        input_ids = torch.from_numpy(out.input_ids).to(self.device, torch.long)
        positions = torch.from_numpy(out.positions).to(self.device)
        hidden = self.model(input_ids, positions, self.attn)
        rows = hidden[torch.from_numpy(out.logits_indices).to(self.device)]
        return self.model.compute_logits(rows)
