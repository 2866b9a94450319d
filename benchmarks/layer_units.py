"""Compile units of one layer: a probe of what the model's per-sublayer units cost.

The model compiles, checkpoints and shards each of its 2L sublayers (``model.layers``), where
torchtitan's decoder compiles one ``TransformerBlock`` per layer. Where a step is host work, a
compiled call costs the same whatever its size, so the unit is part of a step's time. This
module rebuilds a model's forward with one compiled :class:`LayerUnit` per layer (its attention
and MLP sublayers, and the read between them), for ``benchmarks.overhead``'s ``<variant>:layer``
names. The numbers are the model's own (the same sublayers, router and reads; tested).

Where it applies: the plain residual, and Block source sets whose block ends all fall after an
MLP sublayer (an even number of sublayers per block; then the read between a layer's two
sublayers is always a merge with the partial the attention wrote), on the fused backends,
without activation checkpointing, on plain tensors (no tensor parallel). The rest is refused
with a one-line error: Full (read in pairs) and a block end between a layer's two sublayers
would need the router's bookkeeping (a phase-1 read) between them, which a compiled unit does
not run; activation checkpointing and the reference backend are not tried this way.
"""

from __future__ import annotations

import types

from torch import nn


class LayerUnit(nn.Module):
    """Sublayers 2i+1 (attention) and 2i+2 (MLP) in one graph. The MLP's input is site 2i+1's
    read: its phase-1 part ``h_mlp`` and ``mlp_read`` (``Sublayer.forward``'s ``read``), whose
    partial is the attention's output, made here; None for the plain residual, whose MLP takes
    the attention's output itself."""

    def __init__(self, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attention, self.mlp = attention, mlp

    def forward(self, h, read, h_mlp, mlp_read, attention_masks=None, positions=None):
        out = self.attention(h, attention_masks, positions, read)
        if mlp_read is None:
            return self.mlp(out, attention_masks, positions, None)
        partial, key = out if isinstance(out, tuple) else (out, None)
        lse, _, _, query, backend, dtype, add = mlp_read
        return self.mlp(
            h_mlp, attention_masks, positions, (lse, partial, key, query, backend, dtype, add)
        )


def check(model) -> None:
    """A ValueError unless :func:`per_layer` keeps the numbers of ``model`` (module docstring)."""
    router = model.router
    if len(model.layers) % 2:
        raise ValueError("layer units need an attention + MLP pair per layer")
    if router.variant == "baseline":
        return
    if router.reads_pairs or any(e % 2 for e in router.ends):
        raise ValueError(
            "layer units need every block end after an MLP sublayer (an even number of "
            f"sublayers per block); this model's ends are {list(router.ends)}"
        )
    if router.backend == "reference" or router.recompute_reads:
        raise ValueError("layer units need a fused backend and no activation checkpointing")


def per_layer(model, compile_: bool = True) -> list[LayerUnit]:
    """Gives ``model`` a forward whose depth loop calls one :class:`LayerUnit` per layer
    (compiled with ``fullgraph=True`` unless ``compile_`` is False; one code object per model,
    as ``benchmarks.overhead`` gives each model's units). Returns the units."""
    from custom_ops.ops import own_code

    check(model)
    cls = type("LayerUnit", (LayerUnit,), {"forward": own_code(LayerUnit.forward)})
    sublayers = list(model.layers.values())
    units = [cls(a, m) for a, m in zip(sublayers[0::2], sublayers[1::2], strict=True)]
    if compile_:
        for unit in units:
            unit.compile(backend="inductor", fullgraph=True)

    def depth(self, embedding, masks, positions):
        router, baseline = self.router, self.router.variant == "baseline"
        state = router.start(embedding)
        # the router's step for each attention takes a stand-in for its output, which the unit
        # makes; the step only keeps it as the partial (the MLP's read takes the real one)
        stand_in = (embedding, state.embedding_key) if router.projected else embedding
        h, read = embedding, None
        for i, unit in enumerate(units):
            mlp_read = h_mlp = None
            if not baseline:
                h_mlp, mlp_read = router.step(state, 2 * i + 1, stand_in)
                if mlp_read is None or mlp_read[1] is None:
                    raise RuntimeError(f"site {2 * i + 1}: expected a merge with the partial")
            out = unit(h, read, h_mlp, mlp_read, masks, positions)
            h, read = router.step(state, 2 * i + 2, out)
        return router.finish(h, read)

    def forward(self, tokens, positions=None, attention_masks=None):  # LRAttnResModel.forward's
        h = self.norm(depth(self, self.tok_embeddings(tokens), attention_masks, positions))
        return h if self._skip_lm_head else self.lm_head(h)

    model.forward = types.MethodType(forward, model)
    return units
