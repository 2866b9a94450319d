"""The flavors and ``build_model_config(flavor, *, variant, blocks, rank, ...)``, the model
config (the ModelSpec around it: ``titan_lrattnres.spec.model_registry``).

Flavors follow docs/method.md §6 (no biases, untied head, RoPE θ = 5e5, qk-norm, parameter-free
RMSNorms, init N(0, 0.02)); ``debug`` is sized for seconds-per-step CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
)

from custom_ops import BACKENDS
from custom_ops.schedule import check_schedule
from titan_lrattnres.model.depth import DepthPlan
from titan_lrattnres.model.flops import VARIANTS
from titan_lrattnres.model.model import EmbeddingKey, Layer, LRAttnResModel, VocabHead


@dataclass(frozen=True)
class Flavor:
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    vocab_size: int
    max_seq_len: int


FLAVORS: dict[str, Flavor] = {
    # CPU-sized: seconds per step on 2 cores.
    "debug": Flavor(
        dim=64, n_layers=2, n_heads=4, hidden_dim=192, vocab_size=4096, max_seq_len=512
    ),
    "cpu_small": Flavor(
        dim=128, n_layers=4, n_heads=4, hidden_dim=384, vocab_size=4096, max_seq_len=1024
    ),
    # Depth stress test for compile: the paper's depth at a tiny width.
    "deep_debug": Flavor(
        dim=64, n_layers=24, n_heads=4, hidden_dim=192, vocab_size=4096, max_seq_len=512
    ),
    # docs/method.md §6: the paper's ~0.5B model (cl100k vocabulary).
    "paper_0p5b": Flavor(
        dim=1024, n_layers=24, n_heads=16, hidden_dim=2816, vocab_size=100277, max_seq_len=2048
    ),
}

_INIT = {"weight": partial(nn.init.normal_, std=0.02)}
# Embedding and head rows are padded to a multiple of this (the padded logits are masked), so
# every tensor-parallel degree dividing it (1, 2, 4, ..., 64) shards the vocabulary evenly and a
# checkpoint has the same shapes under every layout. cl100k: 100,277 -> 100,288 rows.
VOCAB_MULTIPLE = 64
DEFAULT_BLOCKS = 8


class _Unset:
    def __repr__(self) -> str:
        return f"the default ({DEFAULT_BLOCKS})"


UNSET = _Unset()  # ``blocks`` not given: DEFAULT_BLOCKS, unless ``block_layers`` is


def schedule_kwargs(blocks: int | None, block_layers: int | None) -> dict:
    """``build_model_config``'s schedule arguments from a record that holds both fields, None
    for unset (a run summary, a named config): ``block_layers`` when it is set (a None count
    beside it is not given), else ``blocks`` (None = Full). Both set are passed on, and refused.

    With ``build_model_config``'s own default (``blocks`` not given: DEFAULT_BLOCKS, unless
    ``block_layers`` is), the one place where ``blocks`` and ``block_layers`` are resolved."""
    if block_layers is None:
        return {"blocks": blocks}
    if blocks is None:
        return {"block_layers": block_layers}
    return {"blocks": blocks, "block_layers": block_layers}


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """What a trained model is, beyond its flavor's shape: the one list of these fields. Every
    record of a model is written from it and read into it: the checkpoint fingerprint
    (``fingerprint``), the run summary (``record``), the model arguments of a trained run
    (``model_args``) and the sweep's key for one model across tables (``key``)."""

    variant: str
    blocks: int | None = None
    block_layers: int | None = None
    rank: int | None = None
    eps: float | None = None
    flavor: str | None = None
    vocab_size: int | None = None  # the real vocabulary (the head's rows are padded)

    @classmethod
    def of(cls, config: LRAttnResModel.Config, flavor: str | None = None) -> ModelIdentity:
        r = config.router
        return cls(variant=r.variant, blocks=r.blocks, block_layers=r.block_layers,
                   rank=r.rank, eps=r.eps, flavor=flavor, vocab_size=config.vocab_size)  # fmt: skip

    @classmethod
    def from_record(cls, record: dict) -> ModelIdentity:
        """From any record written by ``record`` (or a row holding its fields)."""
        names = cls.__dataclass_fields__
        return cls(**{k: record[k] for k in names if record.get(k) is not None})

    def record(self) -> dict:
        """Every field, as a run summary keeps them."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def fingerprint(self) -> dict:
        """The fields that decide the parameters' meaning: blocks and rank only where the
        variant routes (a checkpoint's fingerprint adds the shape)."""
        routed = self.variant != "baseline"
        return {
            "variant": self.variant,
            "rank": self.rank if routed else None,
            "blocks": self.blocks if routed else None,
            "block_layers": self.block_layers,
            "eps": self.eps,
        }

    def model_args(self) -> dict:
        """``build_model_config`` arguments (with ``flavor``) of this model."""
        args = {k: getattr(self, k) for k in ("flavor", "variant", "rank", "eps", "vocab_size")}
        args = {k: v for k, v in args.items() if v is not None}
        return {**args, **schedule_kwargs(self.blocks, self.block_layers)}

    def key(self) -> tuple:
        """What identifies the model across tables: blocks and rank only where they apply."""
        if self.variant == "baseline":
            return ("baseline",)
        rank = None if self.variant == "attnres" else self.rank
        return (self.variant, self.blocks, self.block_layers, rank)


def _check_choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {list(allowed)}, got {value!r}")


def build_model_config(
    flavor: str | Flavor,
    *,
    variant: str = "sliced",
    blocks: int | None | _Unset = UNSET,
    block_layers: int | None = None,
    rank: int = 64,
    eps: float | None = None,
    depth_backend: str = "auto",
    attn_backend: str = "auto",
    vocab_size: int | None = None,
    vocab_multiple: int = VOCAB_MULTIPLE,
) -> LRAttnResModel.Config:
    """The model config; every bad field fails here with the field and its allowed range.

    Block AttnRes by count (``blocks=N``, default 8; None = Full) or by size in layers
    (``block_layers=k``: a block end every 2k sublayers, the last block partial), not both.
    """
    if isinstance(flavor, str):
        _check_choice("flavor", flavor, FLAVORS)
        flavor = FLAVORS[flavor]
    _check_choice("variant", variant, VARIANTS)
    _check_choice("depth_backend", depth_backend, BACKENDS)
    d, n_layers, m = flavor.dim, flavor.n_layers, 2 * flavor.n_layers
    given = blocks is not UNSET  # an explicit None (Full) is given too
    if not given:
        blocks = DEFAULT_BLOCKS if block_layers is None else None
    both = given and block_layers is not None  # refused by check_schedule, for every variant
    if variant == "baseline" and not both:  # no routing: blocks and rank do not apply
        blocks = block_layers = None
    check_schedule(m, blocks, block_layers, count_field="blocks", count_given=given)
    r = d if variant == "attnres" else rank
    if variant in ("sliced", "projected") and not (isinstance(rank, int) and 1 <= rank <= d):
        raise ValueError(f"rank must be an int in [1, {d}] (= d), got {rank!r}")
    vocab = vocab_size or flavor.vocab_size
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    if not (isinstance(vocab_multiple, int) and vocab_multiple >= 1):
        raise ValueError(f"vocab_multiple must be an int >= 1, got {vocab_multiple!r}")
    rows = -(-vocab // vocab_multiple) * vocab_multiple  # embedding / head rows
    if attn_backend == "auto":
        attn_backend = "flex" if torch.cuda.is_available() else "sdpa"
    # SDPA (causal only) is the CPU path: FlexAttention has no CPU backward.
    inner = (
        ScaledDotProductAttention.Config()
        if attn_backend == "sdpa"
        else get_attention_config(attn_backend)
    )
    head_dim = d // flavor.n_heads
    key_rank = rank if variant == "projected" else 0

    def norm() -> RMSNorm.Config:  # one object per module: TP/SP give them different layouts
        return RMSNorm.Config(normalized_shape=d, elementwise_affine=False)

    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=flavor.max_seq_len, theta=500000.0)
    plan = DepthPlan(
        variant=variant,
        dim=d,
        rank=r,
        num_sublayers=m,
        blocks=blocks,
        block_layers=block_layers,
        eps=eps,
        backend=depth_backend,
    )
    queries = {"queries": nn.init.zeros_} if plan.routed else {}  # uniform reads
    layers = []
    for i in range(n_layers):
        attention = make_gqa_config(
            dim=d,
            n_heads=flavor.n_heads,
            wqkv_param_init=_INIT,
            wo_param_init=_INIT,
            inner_attention=inner,
            rope=rope,
            fuse_qkv=True,
            qk_norm=RMSNorm.Config(normalized_shape=head_dim, elementwise_affine=False),
        )
        ffn = make_ffn_config(
            dim=d, hidden_dim=flavor.hidden_dim, w1_param_init=_INIT, w2w3_param_init=_INIT
        )
        if key_rank:  # one fused [W^O; W^K] weight, a torchtitan Linear (float8-convertible)
            attention.wo = Linear.Config(in_features=d, out_features=d + key_rank, param_init=_INIT)
            ffn.w2 = Linear.Config(
                in_features=flavor.hidden_dim, out_features=d + key_rank, param_init=_INIT
            )
        layers.append(
            Layer.Config(
                dim=d,
                depth=plan,
                index=i,
                key_rank=key_rank,
                attention=attention,
                feed_forward=ffn,
                attention_norm=norm(),
                ffn_norm=norm(),
                param_init=dict(queries),
            )
        )
    return LRAttnResModel.Config(
        dim=d,
        vocab_size=vocab,
        hidden_dim=flavor.hidden_dim,
        tok_embeddings=Embedding.Config(num_embeddings=rows, embedding_dim=d, param_init=_INIT),
        norm=norm(),
        lm_head=VocabHead.Config(
            in_features=d, out_features=rows, vocab_size=vocab, param_init=_INIT
        ),
        layers=layers,
        router=plan,
        embedding_key=(
            EmbeddingKey.Config(in_features=d, out_features=rank, eps=plan.eps, param_init=_INIT)
            if variant == "projected"
            else None
        ),
    )
