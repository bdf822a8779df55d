"""KV tensors and the plans that move blocks: device and host pools with one shape.

Layout: ``[layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's NHD per
layer; block 0 is the null block). Each plan is one batched index copy over all layers at once,
run in the order swap-out, swap-in, copy (the scheduler's contract).
"""

from __future__ import annotations

import numpy as np
import torch


class KvCache:
    def __init__(
        self,
        num_layers: int,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.device_kv = torch.zeros(
            (shape[0], num_device_blocks + 1, *shape[1:]), dtype=dtype, device=device
        )
        pin = device.type == "cuda"
        # host blocks are always written (swap-out) before they are read, so their memory is
        # left untouched until used; device blocks are zeroed because the null block pads reads
        self.host_kv = torch.empty((shape[0], num_host_blocks + 1, *shape[1:]), dtype=dtype, pin_memory=pin)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers
            * 2
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    def run_plans(self, swap_out: np.ndarray, swap_in: np.ndarray, copy: np.ndarray) -> None:
        if len(swap_out):
            src = torch.from_numpy(swap_out[:, 0]).to(self.device_kv.device, torch.long)
            dst = torch.from_numpy(swap_out[:, 1]).long()
            self.host_kv[:, dst] = self.device_kv[:, src].to("cpu")
        if len(swap_in):
            src = torch.from_numpy(swap_in[:, 0]).long()
            dst = torch.from_numpy(swap_in[:, 1]).to(self.device_kv.device, torch.long)
            self.device_kv[:, dst] = self.host_kv[:, src].to(self.device_kv.device)
        if len(copy):
            idx = torch.from_numpy(copy).to(self.device_kv.device, torch.long)
            self.device_kv[:, idx[:, 1]] = self.device_kv[:, idx[:, 0]]
