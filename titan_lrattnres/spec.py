"""``model_registry(flavor, *, variant, blocks, rank, ...) -> ModelSpec``: the model wired to its
parallelism, as torchtitan's own model folders wire theirs.

The model config comes from :func:`titan_lrattnres.model.registry.build_model_config`, the
parallelize function is torchtitan's llama3 one (driven by the sharding declarations of
``titan_lrattnres.parallel.sharding``) with each layer compiled per layer plan
(:mod:`titan_lrattnres.parallel.compile`), the pipeline function is
:func:`titan_lrattnres.parallel.pipeline.pipeline_lrattnres`. This module sits above both
``model/`` and ``parallel/`` (README.md, "Layers"): it is where the model's config
hook ``update_from_config`` gets the parallel layer's checks and sharding declarations.
"""

from __future__ import annotations

from torchtitan.protocols.model_spec import ModelSpec

from titan_lrattnres.model.model import LRAttnResModel
from titan_lrattnres.model.registry import build_model_config
from titan_lrattnres.parallel.compile import parallelize_lrattnres
from titan_lrattnres.parallel.pipeline import pipeline_lrattnres
from titan_lrattnres.parallel.sharding import configure_parallelism

LRAttnResModel.Config.configure_parallelism = configure_parallelism


def model_registry(flavor: str, *, converters=None, **kwargs) -> ModelSpec:
    """ModelSpec for ``flavor`` with ``variant`` in baseline / attnres / sliced / projected,
    ``blocks`` (None = Full), ``rank``, ``eps``, ``depth_backend``, ``attn_backend``,
    ``vocab_size``, ``vocab_multiple``."""
    config = build_model_config(flavor, **kwargs)
    if converters is not None:
        for c in converters:
            config = c.build().convert(config)
    return ModelSpec(
        name="lrattnres",
        flavor=flavor,
        model=config,
        parallelize_fn=parallelize_lrattnres,
        pipelining_fn=pipeline_lrattnres,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
