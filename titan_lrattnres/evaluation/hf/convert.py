"""The project's model -> a Hugging Face folder (``--format hf``).

:func:`export_hf` writes ``config.json`` (with ``auto_map``), ``model.safetensors``,
``generation_config.json`` (the end-of-text id), the tokenizer files and the two remote-code
files, so that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it
offline without this package. Weight names (torchtitan state dict -> transformers):

    tok_embeddings / lm_head              first V (real vocabulary) rows only
    layers.{i}.attention.qkv_linear.w{q,k,v}  -> model.layers.{i}.self_attn.{q,k,v}_proj
    layers.{i}.attention.wo   [d (+ r)]   -> self_attn.o_proj (first d rows), .depth_key_proj (r)
    layers.{i}.feed_forward.w1 / w3       -> mlp.gate_proj / mlp.up_proj
    layers.{i}.feed_forward.w2 [d (+ r)]  -> mlp.down_proj (first d rows), mlp.depth_key_proj
    layers.{i}.queries [n_i, r], i = 0..L-1 -> model.router.queries [2L, r] (fp32; row t-1 = site t)
    embedding_key                         -> model.router.embedding_key
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from titan_lrattnres.evaluation.hf import configuration_lrattnres, modeling_lrattnres
from titan_lrattnres.evaluation.hf.configuration_lrattnres import LRAttnResConfig
from titan_lrattnres.evaluation.hf.modeling_lrattnres import LRAttnResForCausalLM, schedule_ends

EOT = "<|endoftext|>"
AUTO_MAP = {
    "AutoConfig": "configuration_lrattnres.LRAttnResConfig",
    "AutoModel": "modeling_lrattnres.LRAttnResModel",
    "AutoModelForCausalLM": "modeling_lrattnres.LRAttnResForCausalLM",
}
REMOTE_CODE = (configuration_lrattnres, modeling_lrattnres)


def hf_config(model, **extra) -> LRAttnResConfig:
    """The transformers config of a built project model (read from its modules, so that every
    flavor, variant and schedule maps without the registry's defaults)."""
    router = model.router
    layers = list(model.layers.values())
    attn, ffn = layers[0].attention, layers[0].feed_forward
    m = 2 * len(layers)  # sublayers
    rope = attn.rope.config
    if rope.scaling != "none":
        raise NotImplementedError(f"RoPE scaling {rope.scaling!r} has no HF port here")
    eps = {model.norm.eps, layers[0].attention_norm.eps, layers[0].ffn_norm.eps}
    if attn.q_norm is not None:
        eps |= {attn.q_norm.eps, attn.k_norm.eps}
    if len(eps) != 1:
        raise NotImplementedError(f"one RMSNorm eps is ported, the model has {sorted(eps)}")
    variant = router.variant
    blocks = block_layers = None
    if variant != "baseline":
        if router.block_layers is not None:
            block_layers = router.block_layers
        elif list(router.ends) != list(range(1, m + 1)):
            blocks = len(router.ends)
        if schedule_ends(m, blocks, block_layers) != list(router.ends):
            raise ValueError(f"block ends {router.ends} have no blocks / block_layers form")
    key_eps = router.eps if router.eps is not None else modeling_lrattnres.DEFAULT_KEY_EPS
    return LRAttnResConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.tok_embeddings.embedding_dim,
        intermediate_size=ffn.w1.out_features,
        num_hidden_layers=m // 2,
        num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads,
        max_position_embeddings=rope.max_seq_len,
        rope_theta=float(rope.theta),
        rms_norm_eps=float(eps.pop()),
        qk_norm=attn.q_norm is not None,
        variant=variant,
        key_rank=0 if variant == "baseline" else router.rank,
        blocks=blocks,
        block_layers=block_layers,
        key_eps=float(key_eps),
        **extra,
    )


def convert_state_dict(state: dict[str, torch.Tensor], config: LRAttnResConfig) -> dict:
    """torchtitan state dict -> transformers state dict (see the module docstring); every
    source tensor must be used."""
    v, d, n = config.vocab_size, config.hidden_size, config.num_hidden_layers
    projected = config.variant == "projected"
    left = dict(state)
    take = left.pop
    out = {
        "model.embed_tokens.weight": take("tok_embeddings.weight")[:v],
        "lm_head.weight": take("lm_head.weight")[:v],
    }

    def split(name: str, o_name: str, prefix: str) -> None:
        w = take(name)
        out[prefix + o_name] = w[:d]
        if projected:
            out[prefix + "depth_key_proj.weight"] = w[d:]
        elif w.shape[0] != d:
            raise ValueError(f"{name} has {w.shape[0]} rows, expected d = {d}")

    for i in range(n):
        a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        sa, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for x in "qkv":
            out[f"{sa}{x}_proj.weight"] = take(f"{a}qkv_linear.w{x}.weight")
        split(a + "wo.weight", "o_proj.weight", sa)
        out[mlp + "gate_proj.weight"] = take(f + "w1.weight")
        out[mlp + "up_proj.weight"] = take(f + "w3.weight")
        split(f + "w2.weight", "down_proj.weight", mlp)
    if config.variant != "baseline":
        # each layer's rows are its sites in order, so the layers in order are sites 1..2L
        queries = [take(f"layers.{i}.queries") for i in range(n)]
        out["model.router.queries"] = torch.cat(queries).float()
    if projected:
        out["model.router.embedding_key.weight"] = take("embedding_key.weight")
    if left:
        raise ValueError(f"unmapped checkpoint tensors: {sorted(left)[:8]}")
    return {
        k: t.detach().cpu().clone(memory_format=torch.contiguous_format) for k, t in out.items()
    }


def to_hf(model, **config_extra) -> LRAttnResForCausalLM:
    """An ``LRAttnResForCausalLM`` (eval mode, same dtype) holding ``model``'s weights."""
    config = hf_config(model, **config_extra)
    state = convert_state_dict(model.state_dict(), config)
    with torch.device("meta"):  # no random init: every tensor comes from ``state``
        hf = LRAttnResForCausalLM(config)
    hf.load_state_dict(state, strict=True, assign=True)  # dtypes as stored; queries fp32
    return hf.eval()


def _tokenizer(path: Path, vocab_size: int, max_len: int):
    """The corpus tokenizer as a transformers fast tokenizer (``<|endoftext|>`` = BOS = EOS =
    pad, left padding for batched generation); refused when its ids exceed the vocabulary."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    size = Tokenizer.from_file(str(path)).get_vocab_size()
    if size > vocab_size:
        raise ValueError(f"{path}: tokenizer has {size} ids, the model only {vocab_size}")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), model_max_length=max_len, padding_side="left"
    )
    if EOT in tok.get_vocab():
        tok.add_special_tokens({"bos_token": EOT, "eos_token": EOT, "pad_token": EOT})
    return tok


def export_hf(model, out_dir: str | Path, *, tokenizer=None) -> dict:
    """Write the Hugging Face folder ``out_dir``; returns a record (files, eos id, tokenizer).

    ``tokenizer``: a ``tokenizer.json`` path (None: the folder has no tokenizer and the
    generation config no end-of-text id)."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = None
    if tokenizer is not None:
        tok = _tokenizer(Path(tokenizer), model.vocab_size, model_max_len(model))
    eot = tok.eos_token_id if tok is not None else None
    ids = dict(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    hf = to_hf(model, **ids)
    hf.config.auto_map = dict(AUTO_MAP)
    hf.generation_config = GenerationConfig(**ids)
    hf.save_pretrained(out)
    for module in REMOTE_CODE:  # the remote code (save_pretrained copies only registered classes)
        shutil.copyfile(module.__file__, out / Path(module.__file__).name)
    if tok is not None:
        tok.save_pretrained(out)
    return {
        "tokenizer": str(tokenizer) if tokenizer is not None else None,
        "eos_token_id": eot,
        "vocab_size": hf.config.vocab_size,
    }


def model_max_len(model) -> int:
    first = next(iter(model.layers.values()))
    return first.attention.rope.config.max_seq_len
