"""LR-AttnRes decoder: 2L residual-writing sublayers and a depth router between them.

``model.layers`` holds the M = 2L sublayers (``"0"`` = attention of layer 1, ``"1"`` = its MLP,
...), so torchtitan's per-unit activation checkpointing, ``compile(fullgraph=True)`` and FSDP2
apply to each sublayer with one fixed signature. ``Decoder.forward`` is replaced by the depth
loop: ``h_t`` = read of site t; sublayer t+1 consumes ``RMSNorm(h_t)``; the final read goes
through the final RMSNorm and the LM head (docs/method.md §1). Parallelism: FSDP2 / HSDP, tensor
parallel with or without sequence parallel, and both together (layouts:
``titan_lrattnres.parallel.sharding``); pipeline parallel (stages, the cross-stage source cache:
``titan_lrattnres.parallel.pipeline``); context parallel with FlexAttention
(``titan_lrattnres.parallel.context``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torchtitan.models.common.attention import AttentionMasksType, GQAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module

from custom_ops.reference import key_rmsnorm
from titan_lrattnres.model.depth import DepthRouter, finish_read
from titan_lrattnres.model.flops import routing_flops


class Sublayer(Module):
    """One residual-writing sublayer j: ``o_j = F_j(RMSNorm(h_{j-1}))``.

    For the projected variant the output projection has d + r rows, one weight ``[W^O; W^K]``;
    ``o_j`` comes with ``RMSNorm(k_j)``, the key normalised at emission (fp32).

    What goes in and out, so that the depth machinery between two sublayers runs inside this
    sublayer's compiled graph (docs/performance.md):

    - ``read`` None: ``h`` is ``h_{j-1}``. Else ``h`` is site j-1's phase-1 read ``out1`` (fp32)
      and ``read = (lse1, partial, partial_key, query, backend, dtype, add)`` what finishes
      it (:meth:`read_input`): its phase-2 merge with the partial, or (partial None: a block
      end) the cast to the activations' ``dtype``. h_{j-1} is made here, where the compiler
      fuses it with the norm, and a checkpoint keeps the phase-1 read, not h.
    - returns ``h_{j-1} + o_j`` for the plain residual (``residual``); ``partial + o_j`` (and
      ``partial_key + k_j``) when ``read`` says to ``add`` (Block: the running partial); else
      ``o_j`` (and k_j; Full's pairs merge sublayer j-1's output in as the partial, but o_j
      is a source of its own).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        norm: RMSNorm.Config
        attention: GQAttention.Config | None = None
        feed_forward: FeedForward.Config | None = None
        key_rank: int = 0  # r extra output rows (projected); 0 = none
        key_eps: float | None = None
        residual: bool = False  # the baseline: the sublayer adds its input to its output

    def __init__(self, config: Config):
        super().__init__()
        if (config.attention is None) == (config.feed_forward is None):
            raise ValueError("a Sublayer has exactly one of attention / feed_forward")
        self.dim = config.dim
        self.key_rank = config.key_rank
        self.key_eps = config.key_eps
        self.residual = config.residual
        self.norm = config.norm.build()
        self.attention = config.attention.build() if config.attention is not None else None
        self.feed_forward = config.feed_forward.build() if config.feed_forward is not None else None

    def forward(
        self,
        h: torch.Tensor,
        attention_masks: AttentionMasksType | None,
        positions: torch.Tensor | None = None,
        read: tuple | None = None,
    ):
        h = self.read_input(h, read)
        x = self.norm(h)
        if self.attention is not None:
            y = self.attention(x, attention_masks, positions)
        else:
            y = self.feed_forward(x)
        return self.write(h, y, read)

    def read_input(self, h: torch.Tensor, read: tuple | None) -> torch.Tensor:
        """``h_{j-1}``: ``h`` itself, or the phase-1 read ``h`` finished as ``read`` says
        (``depth.finish_read``: cast, or merged with the partial; compiled, fused with the norm
        that follows)."""
        return h if read is None else finish_read(h, read, self.key_eps)

    def write(self, h: torch.Tensor, y: torch.Tensor, read: tuple | None = None):
        """What the sublayer hands on, from its input ``h`` and its output projection's result
        ``y [..., d (+ r)]`` (see the class docstring). Always contiguous: a compiled backward
        then gets its tangent in the layout it expects (a column slice of ``[W^O; W^K]`` would
        make AOTAutograd copy every incoming gradient into that slice's strides)."""
        if self.residual:
            return h + y
        k = None
        if self.key_rank:
            y, k = y.split([self.dim, self.key_rank], dim=-1)
            k = key_rmsnorm(k, self.key_eps)
        if read is not None and read[6]:
            y, k = read[1] + y, None if k is None else read[2] + k
        else:
            y = y.contiguous()
        return y if k is None else (y, k)


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
        router: DepthRouter.Config
        hidden_dim: int

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
            # with activation checkpointing the reads keep no phase-1 output either
            self.router.recompute_reads = getattr(config, "activation_checkpoint", None) is not None
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
            return len(self.layers) // 2

    def __init__(self, config: Config):
        super().__init__(config)
        self.vocab_size = config.vocab_size  # real vocabulary (the head may have padded rows)
        self.router = config.router.build()

    def run_depth(self, embedding: torch.Tensor, sublayer_fn, on_read=None) -> torch.Tensor:
        """The depth loop: site 0 is the embedding; sublayer j writes ``sublayer_fn(j, layer,
        h, read)`` (``Sublayer.forward``'s input: h_{j-1}, or its read to finish) and site j
        reads. ``on_read(j, state)`` sees every site's sources. Shared by
        ``forward``, cached decoding and the routing analysis. Returns ``h_M``."""
        state = self.router.start(embedding)
        h, read = embedding, None
        for j, layer in enumerate(self.layers.values(), start=1):
            out = sublayer_fn(j, layer, h, read)
            h, read = self.router.step(state, j, out)
            if on_read is not None:
                on_read(j, state)
        return self.router.finish(h, read)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
    ):
        h = self.run_depth(
            self.tok_embeddings(tokens),
            lambda j, layer, h, read: layer(h, attention_masks, positions, read),
        )
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)
