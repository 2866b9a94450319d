"""LR-AttnRes decoder: L layers, each one unit with the depth reads that feed its sublayers.

``model.layers`` holds L :class:`Layer` modules, as torchtitan's decoder holds its transformer
blocks, so torchtitan's per-block activation checkpointing, ``compile(fullgraph=True)`` and
FSDP2 apply to each layer. A layer takes the stream ``(h, sources, keys, partial, partial_key)``
and gives it back, with every depth read that feeds its sublayers inside its own graph
(``titan_lrattnres.model.depth``); a routed layer reads its own input, so its ``h`` is None
but for the last layer's output, the final read. Parallelism: FSDP2 / HSDP, tensor parallel
with or without sequence parallel (``titan_lrattnres.parallel.sharding``); pipeline parallel
(stages cut between layers, the cross-stage source cache: ``titan_lrattnres.parallel.pipeline``);
context parallel with FlexAttention (``titan_lrattnres.parallel.context``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.linear import Linear
from torchtitan.models.utils import get_dense_model_nparams_and_flops

from custom_ops.ops import own_code
from custom_ops.reference import key_rmsnorm
from titan_lrattnres.model.depth import (
    DepthPlan,
    LayerPlan,
    completed_read,
    read_backend,
    site_read,
)
from titan_lrattnres.model.flops import routing_flops

# What flows from layer to layer: h, the completed sources (the embedding, then block sums or,
# for Full, every output), their keys (projected; else None: sliced tails), the running partial
# and its key. The baseline's stream is h alone (the rest None); a routed stream's h is None
# (each layer reads its own input) until the last layer gives the final read.
Stream = tuple

# One forward function per layer plan, shared by every model (see Layer.__init__)
_FORWARDS: dict[tuple, Callable] = {}


def plan_forward(module: nn.Module, layer: Layer) -> None:
    """Give ``module`` (``layer``, or a wrapper around it: torchtitan's activation checkpointing
    wraps each layer) its class's ``forward`` with a code object of its own per layer plan,
    shared by every module of that class and plan (see :class:`Layer`)."""
    fn = type(module).forward
    key = (fn, layer.plan_key)
    if key not in _FORWARDS:
        _FORWARDS[key] = own_code(fn)
    module.forward = types.MethodType(_FORWARDS[key], module)


class Layer(TransformerBlock):
    """Layer i: attention (sublayer 2i+1), MLP (sublayer 2i+2) and the reads that feed them,
    sites 2i (the attention's input; layer 0's is the embedding itself) and 2i+1 (the MLP's);
    the last layer also makes the final read, site 2L.

    ``forward(h, values, keys, partial, partial_key, attention_masks, positions)`` returns
    ``(h, new_values, new_keys, partial, partial_key)``: the sources the layer completed (and
    their keys) and the running partial after it. A routed layer reads its own input from
    ``values`` and ``partial``: ``h`` is None in and out, except the last layer's output, the
    final read. The baseline adds its sublayers' outputs to h, as torchtitan's block does, and
    returns the same tuple with the rest empty. ``queries [n, r]`` (fp32, zero-initialised)
    are the queries of the layer's read sites (``plan.sites``: 1 row for layer 0, 2 for the
    others, one more for the last).

    For the projected variant each output projection has d + r rows, one weight ``[W^O; W^K]``;
    the key is normalised at emission (fp32), and a block's key is the sum of its members'.

    Each distinct plan (sources in, partial in, block ends, first or last) runs its own copy of
    ``forward`` (its own code object), shared by all layers and models with that plan: dynamo
    keeps one set of graphs per code object, so a deep Full model, or several models in one
    process, never exhaust one function's recompile limit. A module wrapping a layer
    (torchtitan's activation checkpointing) gets the same from
    :meth:`LRAttnResModel.plan_forwards`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        dim: int
        depth: DepthPlan
        index: int  # i, 0-based
        key_rank: int = 0  # r extra output rows (projected); 0 = none

    def __init__(self, config: Config):
        super().__init__()
        self.dim = config.dim
        self.key_rank = config.key_rank
        depth = config.depth
        self.plan: LayerPlan | None = depth.layer(config.index) if depth.routed else None
        self.residual = not depth.routed
        self.eps, self.backend = depth.eps, depth.backend
        self.attention = config.attention.build()
        self.feed_forward = config.feed_forward.build()
        self.attention_norm = config.attention_norm.build()
        self.ffn_norm = config.ffn_norm.build()
        if depth.routed:
            self.sites = self.plan.sites
            self.queries = nn.Parameter(
                torch.zeros(len(self.sites), depth.rank, dtype=torch.float32)
            )
            self.ends = self.plan.ends
        self.plan_key = ("baseline",) if self.plan is None else (depth.variant, *self.plan.key)
        plan_forward(self, self)

    def forward(
        self,
        h: torch.Tensor | None,
        values: list[torch.Tensor] | None = None,
        keys: list[torch.Tensor] | None = None,
        partial: torch.Tensor | None = None,
        partial_key: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
        positions: torch.Tensor | None = None,
    ):
        def attend(x):
            return self.attention(x, attention_masks, positions)

        return self.run(attend, h, values, keys, partial, partial_key)

    def run(self, attend, h, values, keys, partial, partial_key, on_read=None):
        """The layer with ``attend(x)`` as its attention (cached decoding passes its own).
        ``on_read(t, values, keys, query)``, if given, sees each site's whole source set."""
        if self.residual:
            h = h + attend(self.attention_norm(h))
            return h + self.feed_forward(self.ffn_norm(h)), (), (), None, None
        backend = read_backend(self.backend, values[0])
        out1, lse1 = completed_read(values, keys, self.queries, self.eps, backend)
        dtype = values[0].dtype
        new_values, new_keys = [], []

        def read(row, partial, partial_key):  # site sites[row]: phase 1 merged with what came since
            extras = [*new_values, *([] if partial is None else [partial])]
            extra_keys = None
            if self.key_rank:
                extra_keys = [*new_keys, *([] if partial is None else [partial_key])]
            query = self.queries[row]
            if on_read is not None:
                all_keys = None if keys is None else [*keys, *extra_keys]
                on_read(self.sites[row], [*values, *extras], all_keys, query)
            if not extras:
                return out1[row].to(dtype)
            args = (extras, extra_keys, query, self.eps, dtype, backend)
            return site_read(out1[row], lse1[row], *args)

        h = values[0] if self.plan.index == 0 else None  # site 0 reads the embedding alone
        row = 0
        sublayers = ((attend, self.attention_norm), (self.feed_forward, self.ffn_norm))
        for s, (sublayer, norm) in enumerate(sublayers):
            if h is None:
                h, row = read(row, partial, partial_key), row + 1
            o, k = self.emit(sublayer(norm(h)))
            h = None
            if partial is None:
                partial, partial_key = o, k
            else:
                partial = partial + o
                partial_key = None if k is None else partial_key + k
            if self.ends[s]:
                new_values.append(partial)
                new_keys.append(partial_key)
                partial = partial_key = None
        if self.plan.last:
            h = read(row, partial, partial_key)
        return h, new_values, new_keys if self.key_rank else (), partial, partial_key

    def emit(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, k)`` from an output projection's result ``y [..., d (+ r)]``: the key
        normalised at emission (fp32), None unless projected."""
        if not self.key_rank:
            return y, None
        o, k = y.split([self.dim, self.key_rank], dim=-1)
        return o, key_rmsnorm(k, self.eps)


class EmbeddingKey(Linear):
    """The projected variant's embedding key ``W_0^K [r, d]``: ``forward(e)`` gives the key of
    the first source, normalised at emission (fp32) like every other key. The trainer compiles
    it as it compiles the layers (``titan_lrattnres.parallel.compile``), so the embedding's key
    and its backward run as one graph each, not as a dozen eager ops."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        eps: float | None = None  # the key RMSNorm's eps (None: the default)

    def __init__(self, config: Config):
        super().__init__(config)
        self.eps = config.eps

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return key_rmsnorm(super().forward(embedding), self.eps)


# Logit of a padded vocabulary row: finite (0 * mask = 0 in entropy-style sums, where -inf would
# give NaN), far below any real logit, exactly 0 after softmax / logsumexp in fp32 and bf16.
PAD_LOGIT = -1e30


class VocabHead(Linear):
    """The LM head: ``out_features`` rows = ``vocab_size`` padded up (``registry.VOCAB_MULTIPLE``);
    the padded logits are set to ``PAD_LOGIT`` so loss, sampling and argmax ignore them.

    Under tensor parallelism the rows are sharded evenly over the TP ranks; each rank masks the
    padded rows of its own shard (the last ranks' shards hold the padding)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        vocab_size: int  # real vocabulary; out_features - vocab_size rows are padding

    def __init__(self, config: Config):
        super().__init__(config)
        if not 1 <= config.vocab_size <= config.out_features:
            raise ValueError(
                f"vocab_size {config.vocab_size} must be in [1, out_features={config.out_features}]"
            )
        self.vocab_size = config.vocab_size
        self._shard = (0, config.out_features)  # (first row, rows) of this rank's shard

    def parallelize(self, parallel_dims) -> None:
        tp = parallel_dims.tp
        if tp > 1:
            rows = self.out_features // tp
            self._shard = (parallel_dims.get_mesh("tp").get_local_rank() * rows, rows)
        super().parallelize(parallel_dims)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input)
        start, rows = self._shard
        real = min(max(self.vocab_size - start, 0), rows)
        if real < rows:  # in place: the matmul does not keep its output for backward
            logits[..., real:].fill_(PAD_LOGIT)
        return logits


class LRAttnResModel(Decoder):
    """Decoder whose residual stream is replaced by a softmax read across depth."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        router: DepthPlan
        hidden_dim: int
        embedding_key: EmbeddingKey.Config | None = None  # projected: W_0^K [r, d]

        # The parallel layer's checks and sharding declarations for a trainer config
        # (``titan_lrattnres.parallel.sharding.configure_parallelism``), called as
        # ``configure_parallelism(model_config, trainer_config)``. The ModelSpec wiring
        # (``titan_lrattnres.spec``) sets it, so the model does not import the layer above it.
        configure_parallelism: ClassVar[Callable | None] = None

        def update_from_config(self, *, config, **kwargs) -> None:
            Decoder.Config.update_from_config(self, config=config, **kwargs)
            configure = type(self).configure_parallelism
            if configure is None:
                raise RuntimeError(
                    "LRAttnResModel.Config.configure_parallelism is not set: build the model "
                    "config through titan_lrattnres.model_registry (titan_lrattnres.spec)"
                )
            configure(self, config)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            attn = self.first_attention
            nparams, flops = get_dense_model_nparams_and_flops(
                model,
                n_layers=self.num_layers,
                n_heads=attn.n_heads,
                head_dims=2 * (self.dim // attn.n_heads),
                seq_len=seq_len,
                enable_weight_tying=self.enable_weight_tying,
            )
            # 6·params already covers the W^K rows and W_0^K; add the read itself (fwd + bwd).
            r = self.router
            read = routing_flops(
                r.variant, self.num_layers, self.dim, self.hidden_dim, r.rank, r.blocks,
                block_layers=r.block_layers,
            )  # fmt: skip
            if r.variant == "projected":
                read -= 2 * r.rank * (self.num_layers * (self.dim + self.hidden_dim) + self.dim)
            return nparams, flops + 3 * read

        @property
        def num_layers(self) -> int:
            return len(self.layers)

    def __init__(self, config: Config):
        super().__init__(config)
        self.vocab_size = config.vocab_size  # real vocabulary (the head may have padded rows)
        self.router = config.router
        self.embedding_key = (
            config.embedding_key.build() if config.embedding_key is not None else None
        )

    def plan_forwards(self) -> None:
        """Give each entry of ``self.layers`` that wraps a layer (torchtitan's activation
        checkpointing wrapper) a forward per layer plan, as the layers have (:class:`Layer`):
        call it after wrapping, before compiling (``titan_lrattnres.parallel.compile``)."""
        for entry in self.layers.values():
            layer = entry
            while not isinstance(layer, Layer):
                layer = layer._checkpoint_wrapped_module
            if entry is not layer:
                plan_forward(entry, layer)

    def depth_queries(self) -> list[nn.Parameter]:
        """Every layer's ``queries [n, r]``, in layer order (rows in site order: 1..2L)."""
        return [layer.queries for layer in self.layers.values() if hasattr(layer, "queries")]

    def set_depth_backend(self, backend: str) -> None:
        """Run the depth reads with ``backend`` (one of ``custom_ops.BACKENDS``) from now on:
        the same weights, another way of computing phase 1."""
        self.router = dataclasses.replace(self.router, backend=backend)
        for layer in self.layers.values():
            layer.backend = backend

    def start(self, embedding: torch.Tensor) -> Stream:
        """The stream before layer 0: the embedding as h (baseline) or as the first source."""
        if not self.router.routed:
            return embedding, None, None, None, None
        keys = None if self.embedding_key is None else [self.embedding_key(embedding)]
        return None, [embedding], keys, None, None

    def run_layers(self, stream: Stream, call=None) -> Stream:
        """The depth loop over ``self.layers``: ``call(layer, *stream)`` (default: the layer
        itself) gives each layer's output; the completed sources are appended. Shared by the
        forward, pipeline stages, cached decoding and the routing analysis."""
        h, values, keys, partial, partial_key = stream
        for layer in self.layers.values():
            args = (h, values, keys, partial, partial_key)
            h, new_values, new_keys, partial, partial_key = (
                layer(*args) if call is None else call(layer, *args)
            )
            if new_values:
                values = [*values, *new_values]
                keys = None if keys is None else [*keys, *new_keys]
        return h, values, keys, partial, partial_key

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
    ):
        def call(layer, *stream):
            return layer(*stream, attention_masks, positions)

        h = self.run_layers(self.start(self.tok_embeddings(tokens)), call)[0]
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)
