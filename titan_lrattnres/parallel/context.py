"""Context parallel (CP): what the model asks of torchtitan's CP, and a CPU stand-in for
FlexAttention that lets torchtitan's own CP machinery run without a GPU.

Every depth read is per token: a token mixes its own sublayer outputs across depth, so each
layer's reads run on CP's sequence shards unchanged, load-balanced order ("headtail": rank i holds
chunks i and 2·cp-1-i) included. What CP needs from the model, and where torchtitan provides it
(``spmd_backend="spmd_types"``, the default):

- inputs, labels and positions sharded and reordered together
  (``prepare_context_parallel_input``); RoPE reads the reordered positions;
- each attention's keys and values all-gathered over CP, their gradients reduce-scattered back
  to the ranks that own them (the inner attention's layout, ``set_gqa_inner_attention_local_map``
  in ``titan_lrattnres.parallel.sharding``), masked by the CP-sharded ``BlockMask`` (which maps
  local query and gathered key indices back to sequence positions): FlexAttention only;
- the depth parameters (each layer's ``layers.<i>.queries``, the projected root
  ``embedding_key``) with their gradients summed over CP: they are declared replicated on CP
  (``dense_param_placement``) and belong to FSDP2 units (a layer's, the root's), which
  torchtitan shards over ``dp_shard`` x ``cp`` (``resolve_fsdp_mesh``), so the reduce-scatter
  sums them over CP as it does every other parameter.

:class:`DenseFlexAttention` is a ``FlexAttention`` whose kernel evaluates the ``BlockMask``'s
mask function densely and runs SDPA's math kernel (which has a CPU backward); FlexAttention has
none. Same mask semantics, so it stands in for FlexAttention on CPU, under CP too: CP=2 against
one process, every gradient, is ``python -m benchmarks.gpu_cp --dry-run`` (and on GPUs, with
FlexAttention, without ``--dry-run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torchtitan.models.common.attention import FlexAttention


def check_context_parallel(model_config, parallelism) -> None:
    """One-line refusals of the CP layouts the model cannot run (CP degree > 1)."""
    cp = parallelism.context_parallel_degree
    if parallelism.spmd_backend == "partial_dtensor":
        raise NotImplementedError(
            f"parallelism.context_parallel_degree={cp} is not checked with parallelism."
            "spmd_backend='partial_dtensor' (CP is held to one process with 'spmd_types', "
            "benchmarks.gpu_cp); use 'spmd_types' (the default)"
        )
    inner = model_config.first_attention.inner_attention
    if not isinstance(inner, FlexAttention.Config):
        name = type(inner).__qualname__.removesuffix(".Config")
        raise NotImplementedError(
            f"parallelism.context_parallel_degree={cp} needs attn_backend='flex' (got {name}): "
            "each rank attends to the gathered keys of a load-balanced token order, which only "
            "the CP-sharded FlexAttention BlockMask masks causally"
        )


class DenseFlexAttention(FlexAttention):
    """FlexAttention's semantics with a dense kernel: the mask is ``create_mask`` of the
    ``BlockMask``'s mask function (``[B, 1, Lq, Lkv]`` booleans), the attention SDPA's math
    kernel. For CPU checks (memory O(Lq·Lkv) per sequence)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"attention_masks must be a BlockMask, got {type(attention_masks)}")
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("DenseFlexAttention takes a mask only")
        q_len, kv_len = q_BLNH.shape[1], k_BLNH.shape[1]
        if attention_masks.seq_lengths != (q_len, kv_len):
            raise ValueError(
                f"the BlockMask is for (q, kv) lengths {attention_masks.seq_lengths}, the "
                f"attention has ({q_len}, {kv_len})"
            )
        batch = attention_masks.kv_num_blocks.shape[0]
        mask = create_mask(attention_masks.mask_mod, batch, 1, q_len, kv_len, q_BLNH.device)
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )
        return out.transpose(1, 2)
