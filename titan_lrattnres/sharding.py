"""Sharding declarations for the spmd_types backend (every parameter must be declared).

LR-AttnRes runs FSDP / HSDP only (tensor, context and pipeline parallel are refused at config
time), so the TP placements below are the llama3 ones for the stock submodules and replicated
for ours; they are what FSDP2's storage axes unfold from.
"""

from __future__ import annotations

import spmd_types as spmd
from torchtitan.models.common.decoder_sharding import (
    dense_activation_placement,
    dense_param_placement,
    set_decoder_sharding_config,
    set_dense_ffn_sharding,
    set_gqa_attention_sharding,
    set_gqa_inner_attention_local_map,
)
from torchtitan.protocols.sharding import ShardingConfig


def _replicated(*names: str) -> ShardingConfig:
    return ShardingConfig(state_shardings={n: dense_param_placement(tp=spmd.R) for n in names})


def set_sharding_config(config) -> None:
    set_decoder_sharding_config(config, enable_sp=False)
    for layer in config.layers:
        if layer.attention is not None:
            set_gqa_attention_sharding(layer.attention, enable_sp=False)
            set_gqa_inner_attention_local_map(layer.attention.inner_attention)
        else:
            set_dense_ffn_sharding(
                layer.feed_forward,
                attn_x_layout=dense_activation_placement(tp=spmd.I),
                enable_sp=False,
            )
    router = config.router
    if router.variant != "baseline":
        router.sharding_config = _replicated("query_bank")
    if router.embedding_key is not None:
        router.embedding_key.sharding_config = _replicated("weight")
