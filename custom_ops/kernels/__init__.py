"""Triton kernels of the depth read, one file per kernel family.

- ``read_fwd``: fused key RMSNorm + logits + online softmax + weighted sum over a query bank.
- ``read_bwd``: recomputing backward of ``read_fwd`` (from the saved log-sum-exp).
- ``merge``: phase-2 merge of a phase-1 read with the live partial source (+ optional RMSNorm).

The S sources are kernel arguments (``common.sources``): tuples of tensors and row strides padded
to a bucket of 8, 16, 32, ... (one compile per bucket), picked in a runtime source loop by a
select over the tuple (``common.pick``). Nothing is uploaded per call, pointers are plain kernel
parameters (a launch can be captured in a CUDA graph), and each tensor keeps Triton's 16-byte
alignment specialisation, so value and gradient rows move in 128-bit accesses.
"""
