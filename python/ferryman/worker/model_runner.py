"""ModelRunner: one step's tensors in, logits of the rows to sample out.

Order within a step: the swap/copy plans, then the attention plan, then the forward, then the
logits of ``logits_indices`` (a row repeats for n > 1)."""

from __future__ import annotations

from typing import Any

import torch

from ferryman._core import SchedulerOutput
from ferryman.attention import TorchAttentionBackend
from ferryman.models.llama import LlamaForCausalLM
from ferryman.worker.kv_cache import KvCache

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KvCache,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        """``attention_backend``: "torch" (the reference; the CPU path), "flashinfer" (CUDA and
        ``ferryman[gpu]``), or "auto" (FlashInfer when both are there, else torch)."""
        self.model = model
        self.kv = kv
        self.device = device
        cfg = model.cfg
        scale = cfg.head_dim**-0.5
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        use_fi = False
        if attention_backend == "flashinfer" or (attention_backend == "auto" and device.type == "cuda"):
            from ferryman.attention.flashinfer_backend import flashinfer_available

            use_fi = device.type == "cuda" and flashinfer_available()
            if attention_backend == "flashinfer" and not use_fi:
                need = "a CUDA device and FlashInfer (pip install ferryman[gpu])"
                raise ValueError(f"attention_backend='flashinfer' needs {need}")
        self.attn: Any
        if use_fi:
            from ferryman.attention.flashinfer_backend import FlashInferBackend

            self.attn = FlashInferBackend(
                kv, block_size, scale, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            )
        else:
            self.attn = TorchAttentionBackend(kv.device_kv, block_size, scale=scale)
        self.attention_backend = "flashinfer" if use_fi else "torch"

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
