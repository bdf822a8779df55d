"""Attention over the paged KV cache. Imported by module, so that no module of the package runs
this one's imports first:

- ``base``: the ``AttentionBackend`` protocol and ``KvWriter``, the one K/V write by slot;
- ``torch_backend``: ``TorchAttentionBackend``, the CPU path and the reference the GPU backend
  is checked against;
- ``flashinfer_backend``: ``FlashInferBackend``, the GPU path (FlashInfer imported lazily);
- ``flashinfer_graphs``: ``DecodeGraphs``, decode-only steps of the GPU path as CUDA graphs;
- ``selector``: ``select_backend``, the "auto" / "torch" / "flashinfer" rule.
"""
