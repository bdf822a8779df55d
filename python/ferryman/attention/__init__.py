"""Attention over the paged KV cache. Imported by module, so that no module of the package runs
this one's imports first:

- ``base``: the ``AttentionBackend`` protocol, ``KvWriter`` (the one K/V write by slot) and
  ``put_inflight`` (input ids still being sampled, written on the device);
- ``torch_backend``: ``TorchAttentionBackend``, the CPU path and the reference the GPU backend
  is checked against;
- ``flashinfer_backend``: ``FlashInferBackend``, the GPU path (FlashInfer imported lazily);
- ``flashinfer_graphs``: ``DecodeGraphs``, decode-only steps of the GPU path as CUDA graphs, and
  ``StepStaging``, the one copy that carries such a step's inputs and page table;
- ``flashinfer_plan``: ``FastDecodePlan``, a graph wrapper's re-plan without FlashInfer's Python
  pass over the batch;
- ``selector``: ``select_backend``, the "auto" / "torch" / "flashinfer" rule.
"""
