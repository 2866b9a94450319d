"""Triton kernels of the depth read, one file per kernel family.

- ``read_fwd``: fused key RMSNorm + logits + online softmax + weighted sum over a query bank.
- ``read_bwd``: recomputing backward of ``read_fwd`` (from the saved log-sum-exp).
- ``merge``: phase-2 merge of a phase-1 read with the live partial source (+ optional RMSNorm).

The list of sources is passed as a small int64 device table of data pointers and row strides
(``common.source_table``), read in the kernel with ``tl.load(...).to(tl.pointer_type(dtype))``.
"""
