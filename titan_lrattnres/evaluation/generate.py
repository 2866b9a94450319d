"""Autoregressive generation with a KV cache, for every variant.

torchtitan's ``GQAttention`` has no cache, so :func:`forward_cached` runs the model's own depth
loop (``model.start`` / ``run_layers``) on the new tokens only, each layer through ``Layer.run``
with an attention of its own: the layer's modules (``qkv_linear``, ``q_norm`` / ``k_norm``,
``rope`` with explicit positions, ``wo``) over the cached keys / values of that layer. Depth
routing is per token: a new token's depth sources are its own sublayer outputs, so the KV cache
is all that decoding keeps between steps (no depth cache survives across steps).

Exactness: RoPE with ``positions = [[p, ..., p+T-1]]`` reads the same rows of the same cache as
the full forward does for those positions, so cached and full logits differ only by the order of
floating-point reductions in attention (tested: fp32 tolerance, identical greedy tokens).

    python -m titan_lrattnres.generate --checkpoint DIR --prompt "def " --max-new-tokens 64 \
        --temperature 0.8 --top-k 50 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch._dynamo.config as _dynamo_config
import torch.nn.functional as F

from custom_ops.ops import own_code

STATIC_ROWS = 256  # a compiled decode's cache length is a multiple of this (or max_seq_len)


class KVCache:
    """Keys / values after RoPE of every layer's attention, by layer index:
    ``[B, max_len, n_kv_heads, hd]``.

    ``static=False`` (eager decoding): attention reads the filled rows ``[:length]``.
    ``static=True`` (the compiled path): the write position is a tensor (``pos``) and attention
    reads every row under a mask of the filled ones, so every call of a given token count has
    the same shapes and one compiled graph serves the whole generation."""

    def __init__(self, model, batch: int, max_len: int, dtype=None, device=None, static=False):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = 0
        self.max_len = max_len
        self.static = static
        p = next(model.parameters())
        device = device or p.device
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # == length, as a tensor
        for i, layer in enumerate(model.layers.values()):
            a = layer.attention
            shape = (batch, max_len, a.n_kv_heads, a.head_dim)
            self.k[i] = torch.zeros(shape, dtype=dtype or p.dtype, device=device)
            self.v[i] = torch.zeros_like(self.k[i])
            if static and torch.device(device).type == "cuda":
                # written in place inside a CUDA graph: a graph may mutate static inputs
                # only; guard=False so a new cache re-records the graph, not recompiles
                for t in (self.k[i], self.v[i]):
                    torch._dynamo.mark_static_address(t, guard=False)

    def reset(self) -> None:
        """Empty, as new (rows zeroed), at the same addresses."""
        for t in (*self.k.values(), *self.v.values()):
            t.zero_()
        self.length = 0
        self.pos.fill_(0)

    def positions(self, t: int) -> torch.Tensor:
        """Positions ``[1, t]`` of the next ``t`` tokens."""
        start = self.pos if self.static else self.length
        return (start + torch.arange(t, device=self.pos.device))[None]

    def reserve(self, t: int) -> None:
        """Refuse ``t`` more tokens when they do not fit (before anything is written)."""
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache full: {self.length + t} > max_len {self.max_len}")

    def advance(self, t: int) -> None:
        self.reserve(t)
        self.length += t
        self.pos.fill_(self.length)

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write layer ``i``'s new tokens' ``k, v [B, T, n_kv, hd]`` at ``positions [1, T]``;
        return ``(keys, values, mask)`` to attend to (mask None: causal within the new tokens)."""
        t = k.shape[1]
        if self.static:
            self.k[i].index_copy_(1, positions[0], k)
            self.v[i].index_copy_(1, positions[0], v)
            rows = torch.arange(self.max_len, device=k.device)
            return self.k[i], self.v[i], rows[None, :] <= positions[0][:, None]
        start, end = self.length, self.length + t  # room reserved by the caller
        self.k[i][:, start:end] = k
        self.v[i][:, start:end] = v
        mask = None
        if 1 < t < end:  # a chunk after a prefix: causal within the chunk, the prefix visible
            mask = torch.ones(t, end, dtype=torch.bool, device=k.device).tril(end - t)
        return self.k[i][:, :end], self.v[i][:, :end], mask


def max_seq_len(model) -> int:
    """The longest sequence RoPE supports (its precomputed cache)."""
    first = next(iter(model.layers.values()))
    return first.attention.rope.cache.shape[0]


def _attention_cached(attn, x, cache: KVCache, i: int, positions: torch.Tensor):
    """Layer ``i``'s attention of ``x`` (its normed input) over its cached keys / values and
    the new ones (written to the cache)."""
    xq, xk, xv = attn.qkv_linear(x)
    if attn.q_norm is not None:
        xq, xk = attn.q_norm(xq), attn.k_norm(xk)
    xq, xk = attn.rope(xq, xk, positions)
    k, v, mask = cache.append(i, xk, xv, positions)
    t, s = xq.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        xq.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=(mask is None and t == s and t > 1),
        scale=attn.scaling,
        enable_gqa=attn.enable_gqa,
    )
    return attn.wo(out.transpose(1, 2).contiguous().flatten(2))


def _forward_cached(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    positions = cache.positions(tokens.shape[1])
    done = [0]  # layers run so far: the next layer's index (run_layers goes in order)

    def call(layer, *stream):
        i = done[0]
        done[0] = i + 1

        def attend(x):
            return _attention_cached(layer.attention, x, cache, i, positions)

        return layer.run(attend, *stream)

    h = model.run_layers(model.start(model.tok_embeddings(tokens)), call)[0]
    return model.lm_head(model.norm(h))


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``tokens [B, T]`` at positions ``cache.length ..``; the cache
    grows by T. The model's own depth loop (``start`` / ``run_layers``), each layer's
    ``Layer.run`` with its attention over the KV cache."""
    cache.reserve(tokens.shape[1])
    logits = _forward_cached(model, tokens, cache)
    cache.advance(tokens.shape[1])
    return logits


class CompiledForward:
    """``forward_cached`` compiled: the one-token step as one static-shape graph per batch size
    (``dynamic=False``; on CUDA captured in a CUDA graph) and the prefill as one graph dynamic in
    length (and in batch, past a batch of 1). Inside both, the depth reads run as the ``reference``
    backend's aten ops, which Inductor fuses with the code around them (no op call per read
    site). Needs a ``KVCache(..., static=True)``. Same numbers as ``forward_cached`` up to the
    order of floating-point reductions (tested: greedy tokens identical)."""

    def __init__(self, model, *, cuda_graphs: bool | None = None):
        self.model = model
        device = next(model.parameters()).device
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        # CPU: the step's generated kernels run on one thread (each is a few thousand elements:
        # an OpenMP region per kernel costs more than it saves; the matmuls keep their threads),
        # called from a C++ wrapper (a Python one costs a few microseconds per buffer and kernel)
        options = (
            {"triton.cudagraphs": True} if cuda_graphs else {"cpp.threads": 1, "cpp_wrapper": True}
        )
        self.cuda_graphs = cuda_graphs
        self.decode = torch.compile(
            own_code(_forward_cached), fullgraph=True, dynamic=False, options=options
        )
        self.prefill = torch.compile(own_code(_forward_cached), fullgraph=True, dynamic=True)
        self._caches: dict[tuple[int, int], KVCache] = {}
        self._last_step = None  # (cache, tokens' shape / dtype / device) of the last guarded step

    def cache(self, batch: int, max_len: int) -> KVCache:
        """A static cache for ``batch`` rows of ``max_len`` tokens, emptied: one per size, kept
        and reused by every ``generate`` call. On CUDA the step's graph is recorded on a
        cache's memory; a new cache at new addresses would make CUDA-graph trees record and
        keep one more graph per call, and check each step against all of them."""
        cache = self._caches.get((batch, max_len))
        if cache is None:
            cache = self._caches[batch, max_len] = KVCache(self.model, batch, max_len, static=True)
        else:
            cache.reset()
        return cache

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache: KVCache, *, guards: bool = True):
        """Logits of ``tokens`` at the cache's position; the cache grows by their count.

        ``guards=False``: a loop's next one-token step, from a caller that changed nothing but
        the tokens' values and the cache's contents since its last step (``generate`` and the
        decode benchmark do so). Dynamo then skips its guards (a few tens of microseconds a
        step at ``cpu_small``) and runs only the checks that tell its graphs apart. Honoured
        only when this object's last step ran guarded on the same cache with tokens of the
        same shape, dtype and device; any other call runs its guards (and compiles if needed).
        """
        from titan_lrattnres.evaluation.inference import depth_backend

        if not cache.static:
            raise ValueError("CompiledForward needs a KVCache(..., static=True)")
        t = tokens.shape[1]
        cache.reserve(t)
        fn = self.decode if t == 1 else self.prefill
        key = (cache, tokens.shape, tokens.dtype, tokens.device)
        trusted = not guards and t == 1 and self._last_step is not None
        trusted = trusted and self._last_step[0] is cache and self._last_step[1:] == key[1:]
        if self.cuda_graphs and t == 1:
            # a new step: the previous step's logits (graph memory) may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        # a decode graph per batch size (and cache length): room for many
        with depth_backend(self.model, "reference"), _dynamo_config.patch(recompile_limit=64):
            if trusted:  # (set_stance takes effect when made, and undoes it on exit)
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    logits = fn(self.model, tokens, cache)
            else:
                logits = fn(self.model, tokens, cache)
        self._last_step = key if t == 1 else None
        cache.advance(t)
        return logits


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a decode loop, as it was before afterwards.
    Steps allocate Python objects, which sets the collector off now and then, and with torch's
    object graph behind it a collection is slow: at ``cpu_small`` about a quarter of a compiled
    decode loop's CPU samples were in the collector, and the slowest of 32 steps took 1.9-2.8x
    the median step (1.7-2.0x with it paused). Inference servers freeze or pause it the same
    way. Reference cycles made meanwhile are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator=None):
    """Next ids ``[B, 1]`` from last-position logits ``[B, V]``; temperature <= 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
    eos_id: int | None = None,
    compiled: CompiledForward | bool = False,
) -> torch.Tensor:
    """``prompt [B, T0]`` followed by up to ``max_new_tokens`` generated ids: ``[B, T0 + n]``.

    ``use_cache=False`` re-runs the full forward on the whole sequence at every step (the
    reference the cached path is tested against). ``compiled``: a :class:`CompiledForward` of
    ``model`` (or True: a new one; compiling takes seconds to minutes, so keep one for several
    calls) runs prefill and decode steps. Stops early when every row emitted ``eos_id``.
    """
    model.eval()
    if prompt.dim() == 1:
        prompt = prompt[None]
    total = prompt.shape[1] + max_new_tokens
    if total > max_seq_len(model):
        raise ValueError(
            f"prompt + new tokens = {total} > the model's max_seq_len {max_seq_len(model)}"
        )
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    seq = prompt
    if compiled is True:
        compiled = CompiledForward(model)
    if compiled and (not use_cache or compiled.model is not model):
        raise ValueError("compiled decoding needs use_cache=True and a CompiledForward of model")
    cache = None
    if use_cache and compiled:  # lengths rounded up: similar lengths share one decode graph
        size = min(-(-total // STATIC_ROWS) * STATIC_ROWS, max_seq_len(model))
        cache = compiled.cache(prompt.shape[0], size)
    elif use_cache:
        cache = KVCache(model, prompt.shape[0], total)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    new = prompt
    with gc_paused():
        for i in range(max_new_tokens):
            if not use_cache:
                logits = model(seq)
            elif compiled:  # the first one-token step runs guarded, the later ones need not
                logits = compiled(new, cache, guards=i < 2)
            else:
                logits = forward_cached(model, new, cache)
            nxt = sample_next(logits[:, -1], temperature, top_k, g)
            seq = torch.cat([seq, nxt], dim=1)
            new = nxt
            if eos_id is not None:
                done |= nxt[:, 0] == eos_id
                if bool(done.all()):
                    break
    return seq


def _parse_ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def main(argv=None) -> int:
    from titan_lrattnres.evaluation.inference import (
        add_checkpoint_args,
        default_tokenizer,
        find_tokenizer,
        load_from_cli,
    )

    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint_args(p)
    p.add_argument("--prompt", default="", help="text (with a tokenizer) or token ids '1,2,3'")
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json (default: beside the checkpoint, else the "
        "embedded corpus's when built)",
    )
    p.add_argument("--token-ids", action="store_true", help="treat --prompt as token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="full forward per step (slow)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compiled prefill and decode steps (torch.compile; first call compiles)",
    )
    ns = p.parse_args(argv)
    model, _, path = load_from_cli(ns)
    tok = None
    vocab = model.vocab_size  # real ids only (the embedding rows are padded)
    tok_path = None
    if not ns.token_ids:
        tok_path = ns.tokenizer or find_tokenizer(path) or default_tokenizer(vocab)
    if tok_path is not None:
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_path))
        except ImportError:
            print("`tokenizers` is not installed: prompt and output are token ids")
    eos = tok.token_to_id("<|endoftext|>") if tok is not None else None
    if tok is not None:
        ids = tok.encode(ns.prompt).ids or ([eos] if eos is not None else [0])
    else:
        ids = _parse_ids(ns.prompt) or [0]
    out = generate(
        model,
        torch.tensor([ids]),
        ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        seed=ns.seed,
        use_cache=not ns.no_cache,
        eos_id=eos,
        compiled=ns.compile,
    )
    new_ids = out[0, len(ids) :].tolist()
    if tok is not None:
        print(ns.prompt + tok.decode(new_ids))
    else:
        print(" ".join(map(str, out[0].tolist())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
