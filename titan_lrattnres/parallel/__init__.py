"""Parallelism: tensor / sequence parallel sharding (``sharding``, ``op_sharding``) and pipeline
parallel (``pipeline_plan``: the static stage plan; ``pipeline``: stages and the source cache)."""
