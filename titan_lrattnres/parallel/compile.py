"""The model spec's ``parallelize_fn``: torchtitan's ``parallelize_llama``, each layer compiled
with a forward of its own per layer plan.

torchtitan compiles each entry of ``model.layers`` with ``fullgraph=True``; dynamo keeps the
graphs of one code object together and stops compiling it after ``recompile_limit`` (8) of
them. The layers of this model differ in how many sources they read, so every layer plan needs
a graph of its own: a layer's forward has its own code object per plan, and so, here, has the
activation-checkpointing wrapper torchtitan puts around it. The steps are torchtitan's own
(tensor parallel, AC, compile, FSDP2), with the compile step run after the others: compiling a
module only marks it, and its hooks run the same either way.
"""

from __future__ import annotations

import dataclasses
import types

from torchtitan.distributed.compile import apply_compile
from torchtitan.models.llama3.parallelize import parallelize_llama

from custom_ops.ops import own_code


def parallelize_lrattnres(model, *, compile_config, parallel_dims, **kwargs):
    """``parallelize_llama`` with each layer compiled through :func:`compile_layers`."""
    off = dataclasses.replace(compile_config, enable=False)
    model = parallelize_llama(model, compile_config=off, parallel_dims=parallel_dims, **kwargs)
    if compile_config.enable and "model" in compile_config.components:
        compile_layers(model, compile_config, parallel_dims)
    return model


def compile_layers(model, compile_config, parallel_dims) -> None:
    """torchtitan's ``apply_compile`` of every layer (or its AC wrapper), after giving each
    wrapper a forward per layer plan (``LRAttnResModel.plan_forwards``); the projected
    variant's embedding key (``model.embedding_key``) is compiled the same way, with a forward
    of its own per model."""
    model.plan_forwards()
    apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    key = getattr(model, "embedding_key", None)
    if key is not None:
        key.forward = types.MethodType(own_code(type(key).forward), key)
        key.compile(backend=compile_config.backend, fullgraph=True)
