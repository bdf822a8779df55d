"""Attention backends over the paged KV cache. ``TorchAttentionBackend`` is the CPU path and the
reference the GPU backend is checked against."""

from ferryman.attention.torch_backend import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
