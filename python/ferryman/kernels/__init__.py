"""Our own GPU kernels (Triton), each beside a torch reference it is tested against.

Nothing here is imported on the CPU path: the model and runner import a kernel module only when
a CUDA runner turns the kernel on. The tests run the kernels on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``), which checks what they compute, not how fast.

- ``skinny_gemm``: ``x @ w.T`` for the few rows of a decode step (the projections cuBLAS leaves
  short of the memory bandwidth at batch 1, docs/gpu.md's profile).
"""
