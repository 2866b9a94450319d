"""LR-AttnRes (Low-Rank Attention Residuals) for Hugging Face transformers.

Copied into every exported folder (remote code for ``trust_remote_code=True``), so it imports only
torch and transformers: the depth read below is a copy of the project's eager reference
(``custom_ops/reference.py``; a test holds the copy to it) and the block schedule a copy of
``custom_ops.schedule.schedule_ends``. The model is the project's (docs/method.md §1-4):

- 2L residual-writing sublayers (attention, SwiGLU MLP), each reading ``RMSNorm(h_{t})``
  (parameter-free); ``h_t`` is a softmax read over depth sources, not a running sum (baseline:
  the running sum ``e + Σ o_j``); the final read goes through the final RMSNorm and the head;
- attention: q/k RMSNorm per head, then RoPE over ADJACENT pairs (torchtitan's complex RoPE, not
  transformers' ``rotate_half``), computed from the positions on the fly;
- keys: attnres / sliced read the tail of each value, projected keys are ``RMSNorm(W^K a)``
  with ``W^K`` (``depth_key_proj``) applied to the output projection's input, block keys are
  sums of member keys; the depth queries (``router.queries [2L, r]``) stay fp32.

Cache: a plain ``DynamicCache`` with one layer per attention sublayer (``layer_idx`` = layer
index). Depth routing is per token, so a new token's reads need only its own sublayer outputs and
nothing else is cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_lrattnres import LRAttnResConfig

# transformers 5.x renamed the cache argument and output field ``past_key_values`` -> ``cache``
_FIELDS = CausalLMOutputWithPast.__dataclass_fields__
_CACHE_FIELD = "cache" if "cache" in _FIELDS else "past_key_values"
DEFAULT_KEY_EPS = torch.finfo(torch.float32).eps


# -- the depth read: a copy of custom_ops/reference.py (docs/method.md §2) ----------------------
def key_rmsnorm(key: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim, in fp32 (rows whose sum of squares reaches 2^120
    are first scaled by 2^-72, exactly, and take no eps, so that k² cannot overflow; written from
    the row's norm so that autograd's intermediates stay in fp32's range)."""
    k = key.float()
    eps = DEFAULT_KEY_EPS if eps is None else float(eps)
    with torch.no_grad():
        big = k.pow(2).sum(-1, keepdim=True) >= 2.0**120
        scale = torch.where(big, 2.0**-72, 1.0).to(k.dtype)
        root_eps = torch.where(big, 0.0, eps**0.5).to(k.dtype)
    k = k * scale
    rms = torch.linalg.vector_norm(k, dim=-1, keepdim=True) / k.shape[-1] ** 0.5
    return k / torch.hypot(rms, root_eps)


def depth_logits(keys, query: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Routing logits ``[S, ...]`` (fp32) of one query ``[r]`` over S raw keys ``[..., r]``."""
    q = query.float()
    return torch.stack([(key_rmsnorm(key, eps) * q).sum(-1) for key in keys])


def depth_read(values, keys, query: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """``h = Σ_s softmax_s(<q, RMSNorm(k_s)>) v_s`` in fp32, returned in the values' dtype;
    source by source as the reference computes it: ``w_s = exp(ℓ_s - max ℓ)``,
    ``α_s = w_s / Σ w``."""
    logits = depth_logits(keys, query, eps)
    weights = list(torch.exp(logits - logits.amax(0)).unbind(0))
    total = sum(weights[1:], weights[0])  # left to right, as the reference adds
    terms = [(w / total).unsqueeze(-1) * v.float() for w, v in zip(weights, values)]
    return sum(terms[1:], terms[0]).to(values[0].dtype)


def schedule_ends(
    num_sublayers: int, blocks: int | None = None, block_layers: int | None = None
) -> list[int]:
    """Block ends in sublayer units (docs/method.md §3): ``ceil(M·i/N)`` for N blocks, every
    ``2·block_layers`` then M by size, every sublayer for Full (both None)."""
    if block_layers is not None:
        return [*range(2 * block_layers, num_sublayers, 2 * block_layers), num_sublayers]
    n = num_sublayers if blocks is None else blocks
    return [-(-num_sublayers * i // n) for i in range(1, n + 1)]


# -- RoPE as the project rotates it -----------------------------------------------------------
def rope_cis(position_ids: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """``e^{i·pos·θ_k}`` ``[B, T, head_dim/2]`` (complex64), torchtitan's ComplexRoPE table rows
    computed for the given positions (no buffer: transformers 5.x empties non-persistent ones)."""
    exps = torch.arange(0, head_dim, 2, device=position_ids.device)[: head_dim // 2].float()
    freqs = 1.0 / (theta ** (exps / head_dim))
    angles = position_ids[..., None].float() * freqs
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, hd]`` by adjacent-dim pairs ``(x_{2k}, x_{2k+1})``, in fp32."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[:, :, None, :]).flatten(3).type_as(x)


# -- attention --------------------------------------------------------------------------------
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, kv, T, hd]`` -> ``[B, kv·n_rep, T, hd]``."""
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Plain softmax attention (``attn_implementation="eager"``); masks are additive or bool."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _key_proj(config: LRAttnResConfig, in_features: int) -> nn.Linear | None:
    """Projected keys: ``W^K`` ``[r, in]`` beside a sublayer's output projection; else None."""
    if config.variant != "projected":
        return None
    return nn.Linear(in_features, config.key_rank, bias=False)


class LRAttnResAttention(nn.Module):
    """Attention sublayer: q/k/v, per-head q/k RMSNorm, RoPE, attention, ``o_proj``; projected
    keys: ``depth_key_proj`` (the ``W^K`` rows of the training model's fused ``wo``)."""

    def __init__(self, config: LRAttnResConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d // heads
        self.num_key_value_groups = heads // kv
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        self.depth_key_proj = _key_proj(config, heads * self.head_dim)

    def forward(self, x, cis, attention_mask, cache):
        """``(o [B, T, d], raw key [B, T, r] or None)``."""
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        if self.config.qk_norm:
            q, k = _rms_norm(q, self.config.rms_norm_eps), _rms_norm(k, self.config.rms_norm_eps)
        q, k = apply_rope(q, cis).transpose(1, 2), apply_rope(k, cis).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        impl = self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        a = out.reshape(b, t, -1).contiguous()
        key = self.depth_key_proj(a) if self.depth_key_proj is not None else None
        return self.o_proj(a), key


class LRAttnResMLP(nn.Module):
    """SwiGLU sublayer ``down(silu(gate(x)) · up(x))``; projected keys from the gated hidden."""

    def __init__(self, config: LRAttnResConfig):
        super().__init__()
        d, h = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.depth_key_proj = _key_proj(config, h)

    def forward(self, x):
        a = F.silu(self.gate_proj(x)) * self.up_proj(x)
        key = self.depth_key_proj(a) if self.depth_key_proj is not None else None
        return self.down_proj(a), key


class LRAttnResDecoderLayer(nn.Module):
    """Layer i: sublayers 2i+1 (attention) and 2i+2 (MLP); no norm weights (parameter-free)."""

    def __init__(self, config: LRAttnResConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LRAttnResAttention(config, layer_idx)
        self.mlp = LRAttnResMLP(config)


class LRAttnResRouter(nn.Module):
    """Depth queries ``[2L, r]`` (row t-1 = read site t, fp32) and, projected, ``W_0^K``."""

    def __init__(self, config: LRAttnResConfig):
        super().__init__()
        m, r = 2 * config.num_hidden_layers, config.key_rank
        self.queries = nn.Parameter(torch.zeros(m, r, dtype=torch.float32))
        projected = config.variant == "projected"
        self.embedding_key = nn.Linear(config.hidden_size, r, bias=False) if projected else None


class LRAttnResPreTrainedModel(PreTrainedModel):
    """Weights init and loading rules shared by the base model and the causal LM."""

    config_class = LRAttnResConfig
    config: LRAttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["LRAttnResDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keep_in_fp32_modules_strict = ["router.queries"]  # fp32 master queries (docs/method.md §2)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LRAttnResRouter):  # zero queries: uniform reads, as in training
            init.zeros_(module.queries)  # transformers' init: skips loaded tensors


class LRAttnResModel(LRAttnResPreTrainedModel):
    """Embedding, the 2L sublayers with the depth reads between them, the final RMSNorm."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]  # AutoModel from a causal-LM folder

    def __init__(self, config: LRAttnResConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LRAttnResDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.router = LRAttnResRouter(config) if config.variant != "baseline" else None
        ends = schedule_ends(2 * config.num_hidden_layers, config.blocks, config.block_layers)
        self._ends = frozenset(ends)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _positions(self, attention_mask, cache, batch: int, length: int, device) -> torch.Tensor:
        """Positions of the new tokens: from a 2-D attention mask (left padding: the first real
        token is position 0), else after the cached length."""
        if attention_mask is not None and attention_mask.dim() == 2:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            return pos[:, -length:]
        past = cache.get_seq_length() if cache is not None else 0
        return torch.arange(past, past + length, device=device).unsqueeze(0).expand(batch, -1)

    def _read(self, values, keys, t: int) -> torch.Tensor:
        """Read site t over its sources (keys None: the values' last r dims, attnres / sliced)."""
        c = self.config
        if keys is None:
            keys = [v[..., c.hidden_size - c.key_rank :] for v in values]
        return depth_read(values, keys, self.router.queries[t - 1], c.key_eps)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        c = self.config
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = c.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=c)
        b, t = e.shape[:2]
        if position_ids is None:
            position_ids = self._positions(attention_mask, cache, b, t, e.device)
        mask = create_causal_mask(c, e, attention_mask, cache, position_ids)
        cis = rope_cis(position_ids, c.hidden_size // c.num_attention_heads, c.rope_theta)

        projected = c.variant == "projected"
        values, keys = [e], None  # site 0: the embedding alone
        if projected:
            keys = [key_rmsnorm(self.router.embedding_key(e), c.key_eps)]
        partial = partial_key = None
        h = e
        for j in range(1, 2 * c.num_hidden_layers + 1):
            layer = self.layers[(j - 1) // 2]
            x = _rms_norm(h, c.rms_norm_eps)
            if j % 2:
                o, k = layer.self_attn(x, cis, mask, cache if use_cache else None)
            else:
                o, k = layer.mlp(x)
            if c.variant == "baseline":
                h = h + o
                continue
            partial = o if partial is None else partial + o
            if projected:  # a block's key: the sum of its members' emission-normalised keys
                k = key_rmsnorm(k, c.key_eps)
                partial_key = k if partial_key is None else partial_key + k
            sources = [*values, partial]
            source_keys = [*keys, partial_key] if projected else None
            if j in self._ends:  # the block is complete: a source from now on, no partial
                values, keys = sources, source_keys
                partial = partial_key = None
            h = self._read(sources, source_keys, j)
        h = _rms_norm(h, c.rms_norm_eps)
        return BaseModelOutputWithPast(
            last_hidden_state=h, **{_CACHE_FIELD: cache if use_cache else None}
        )


class LRAttnResForCausalLM(LRAttnResPreTrainedModel, GenerationMixin):
    """``LRAttnResModel`` and the untied LM head over the real vocabulary."""

    def __init__(self, config: LRAttnResConfig):
        super().__init__(config)
        self.model = LRAttnResModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        h = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)}
        )


__all__ = ["LRAttnResForCausalLM", "LRAttnResModel", "LRAttnResPreTrainedModel"]
