"""Configuration of an LR-AttnRes model for Hugging Face transformers (``model_type="lrattnres"``).

Copied into every exported folder beside ``modeling_lrattnres.py`` (remote code: imports only
transformers). The fields are what the project's ``build_model_config`` decides (docs/method.md
§1-4): the real vocabulary (padded rows are dropped at export), widths, heads, RoPE, norms, the
variant, the key rank and the block schedule (``blocks`` or ``block_layers``; both None = Full).
"""

from __future__ import annotations

from transformers import PretrainedConfig

VARIANTS = ("baseline", "attnres", "sliced", "projected")


class LRAttnResConfig(PretrainedConfig):
    """Pre-norm decoder whose residual stream is a softmax read across depth."""

    model_type = "lrattnres"

    vocab_size: int = 4096  # real vocabulary (the training checkpoint's padded rows dropped)
    hidden_size: int = 64
    intermediate_size: int = 192  # SwiGLU hidden
    num_hidden_layers: int = 2  # L: 2L sublayers, one KV-cache layer per attention sublayer
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None = num_attention_heads
    max_position_embeddings: int = 512  # the training RoPE table's length (computed on the fly)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5  # sublayer, final and q/k norms (parameter-free)
    qk_norm: bool = True
    variant: str = "sliced"  # baseline | attnres | sliced | projected
    key_rank: int = 64  # r (= hidden_size for attnres, 0 for baseline)
    blocks: int | None = None  # Block AttnRes by count N; None (and block_layers None) = Full
    block_layers: int | None = None  # Block AttnRes by size: an end every 2k sublayers
    key_eps: float = 1.1920928955078125e-07  # key RMSNorm eps (fp32 machine epsilon by default)
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {list(VARIANTS)}, got {self.variant!r}")
        if self.variant == "attnres" and self.key_rank != self.hidden_size:
            raise ValueError(f"attnres reads r = d keys: key_rank must be {self.hidden_size}")
        if self.variant in ("sliced", "projected") and not 1 <= self.key_rank <= self.hidden_size:
            raise ValueError(f"key_rank must be in [1, {self.hidden_size}], got {self.key_rank}")
        if self.blocks is not None and self.block_layers is not None:
            raise ValueError("give blocks (a count) or block_layers (a size), not both")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        super().__post_init__(**kwargs)


__all__ = ["LRAttnResConfig"]
