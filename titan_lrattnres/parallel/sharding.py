"""Sharding declarations for the spmd_types backend (every parameter must be declared).

Tensor parallel follows torchtitan's llama3 plan for the stock submodules: ``wqkv``, ``w1``,
``w3`` column-sharded, ``wo``, ``w2`` (the projected ``[W^O; W^K]`` included: its rows are the
output dim, sharding is on the input dim) row-sharded, the head vocabulary-sharded.

Each layer is declared as torchtitan declares a llama3 block: ``attention_norm`` and
``ffn_norm`` with ``norm_config``, the attention and the FFN with torchtitan's helpers. The depth
stream between layers (h, the embedding, block sums, partial, keys) and every read inside a
layer live in the activation layout: with sequence parallel (SP) sequence shards, without SP
replicated (invariant). The depth read is per token (plain aten maths, and the ``lrattnres::``
ops with the DTensor rules of ``parallel/op_sharding.py``), so it runs on either unchanged. The
depth parameters -- each layer's ``queries [n, r]`` (declared on the layer) and the projected
root ``embedding_key`` -- are declared the way torchtitan declares norm weights: ``I`` on TP
without SP (each rank computes the same full gradient), ``R`` with SP (each rank's gradient
covers its own tokens; the partial sums are reduced over TP). Context parallel:
``parallel/context.py``; pipeline parallel: ``parallel/pipeline.py``.
"""

from __future__ import annotations

import dataclasses

import spmd_types as spmd
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.models.common.decoder_sharding import (
    dense_activation_placement,
    dense_param_placement,
    dense_sequence_parallel_placement,
    norm_config,
    set_decoder_sharding_config,
    set_dense_ffn_sharding,
    set_gqa_attention_sharding,
    set_gqa_inner_attention_local_map,
)
from torchtitan.protocols.sharding import ShardingConfig

from titan_lrattnres.components.zloss import ZLossCrossEntropy
from titan_lrattnres.parallel import op_sharding  # noqa: F401  (DTensor rules for the lrattnres:: ops)
from titan_lrattnres.parallel.context import check_context_parallel
from titan_lrattnres.parallel.pipeline_plan import check_schedule


def configure_parallelism(config, trainer_config) -> None:
    """The model config's parallel part of ``update_from_config`` (torchtitan calls it with the
    trainer config): the context and pipeline parallel checks, every module's sharding
    declaration, and with a TP degree > 1 the tensor-parallel checks."""
    parallelism = trainer_config.parallelism
    if parallelism.context_parallel_degree > 1:
        check_context_parallel(config, parallelism)
    if parallelism.pipeline_parallel_degree > 1:
        check_schedule(parallelism.pipeline_parallel_schedule)
    tp = parallelism.tensor_parallel_degree
    enable_sp = tp > 1 and parallelism.enable_sequence_parallel
    set_sharding_config(config, enable_sp=enable_sp)
    if tp > 1:
        set_tensor_parallel(config, trainer_config, tp)


def depth_params(*names: str, enable_sp: bool) -> ShardingConfig:
    """The layout of depth parameters ``names`` (a layer's ``queries``, the embedding key's
    ``weight``): replicated on DP and CP, ``R`` on TP with SP, ``I`` without."""
    tp = spmd.R if enable_sp else spmd.I
    return ShardingConfig(state_shardings={n: dense_param_placement(tp=tp) for n in names})


def set_sharding_config(config, *, enable_sp: bool) -> None:
    """Declare every module's states and activation layouts (``enable_sp``: sequence parallel,
    only meaningful with a TP degree > 1)."""
    set_decoder_sharding_config(config, enable_sp=enable_sp)
    activation = (
        dense_sequence_parallel_placement() if enable_sp else dense_activation_placement(tp=spmd.I)
    )
    for layer in config.layers:
        layer.attention_norm.sharding_config = norm_config(enable_sp=enable_sp)
        layer.ffn_norm.sharding_config = norm_config(enable_sp=enable_sp)
        set_gqa_attention_sharding(layer.attention, enable_sp=enable_sp)
        set_gqa_inner_attention_local_map(layer.attention.inner_attention)
        set_dense_ffn_sharding(layer.feed_forward, attn_x_layout=activation, enable_sp=enable_sp)
        if layer.depth.routed:
            layer.sharding_config = depth_params("queries", enable_sp=enable_sp)
    if config.embedding_key is not None:
        config.embedding_key.sharding_config = depth_params("weight", enable_sp=enable_sp)


# The vocabulary-parallel losses: each TP rank holds a vocabulary shard of the logits, and the
# loss needs the global width (``global_vocab_size``) to place it.
VOCAB_PARALLEL_LOSSES = (CrossEntropyLoss.Config, ZLossCrossEntropy.Config)


def _loss_configs(loss):
    """Every vocabulary-parallel loss config inside a (wrapped) loss config."""
    if isinstance(loss, VOCAB_PARALLEL_LOSSES):
        yield loss
    if dataclasses.is_dataclass(loss):
        for f in dataclasses.fields(loss):
            yield from _loss_configs(getattr(loss, f.name, None))


def set_tensor_parallel(config, trainer_config, tp: int) -> None:
    """Checks for a TP degree ``tp`` > 1, and the loss's vocabulary = the head's (padded) rows.

    The vocabulary-parallel losses (torchtitan's loss-parallel cross-entropy, the z-loss) take
    the global logit width: the padded rows (masked by the head, so the loss is unchanged)
    count. Any other loss is refused."""
    attn = config.first_attention
    rows = config.lm_head.out_features
    checks = {
        "n_heads": attn.n_heads,
        "n_kv_heads": attn.n_kv_heads or attn.n_heads,
        "hidden_dim": config.hidden_dim,
        f"the padded vocabulary (vocab_size {config.vocab_size} padded to a multiple of the "
        "model's vocab_multiple)": rows,
    }
    for what, n in checks.items():
        if n % tp:
            raise ValueError(f"parallelism.tensor_parallel_degree={tp} must divide {what} = {n}")
    loss = getattr(trainer_config, "loss", None)
    for ce in _loss_configs(loss):
        ce.global_vocab_size = rows
    if loss is not None and not any(True for _ in _loss_configs(loss)):
        inner = loss
        while getattr(inner, "loss_fn", None) is not None:  # e.g. ChunkedLossWrapper
            inner = inner.loss_fn
        raise NotImplementedError(
            f"tensor parallel needs a vocabulary-parallel loss (each rank holds a vocabulary "
            f"shard of the logits); {type(inner).__qualname__.removesuffix('.Config')} is not "
            "one: use CrossEntropyLoss (torchtitan's loss-parallel cross-entropy) or "
            "ZLossCrossEntropy, or set parallelism.tensor_parallel_degree=1"
        )
