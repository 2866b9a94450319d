"""A small pre-norm transformer stack (no torchtitan) to time one training step per variant.

Variants (SPEC §1-§4): ``baseline`` (standard residual), ``block`` (standard Block AttnRes, keys
= values, r = d), ``sliced`` (S-LR Block, r = 64), ``projected`` (P-LR Block, r = 32, fused
``[W^O; W^K]`` output projections). Reads use ``custom_ops.block_read`` (phase 1, once per block)
+ ``custom_ops.merge_partial`` (phase 2, with the next sublayer's RMSNorm fused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import custom_ops
from custom_ops import schedule

NORM_EPS = torch.finfo(torch.float32).eps


def rms(x):
    return F.rms_norm(x.float(), (x.shape[-1],), eps=NORM_EPS).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d, heads, extra):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d + extra, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)  # fmt: skip
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d, hidden, extra):
        super().__init__()
        self.up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d + extra, bias=False)

    def forward(self, x):
        a, g = self.up(x).chunk(2, -1)
        return self.down(F.silu(g) * a)


class Stack(nn.Module):
    def __init__(self, variant, layers, d, heads=16, hidden=None, blocks=8, vocab=1024):
        super().__init__()
        hidden = hidden or (11 * d) // 4
        self.variant, self.d = variant, d
        self.rank = {"baseline": 0, "block": d, "sliced": min(64, d), "projected": min(32, d)}[
            variant
        ]
        extra = self.rank if variant == "projected" else 0
        self.embed = nn.Embedding(vocab, d)
        self.sublayers = nn.ModuleList()
        for _ in range(layers):
            self.sublayers += [Attention(d, heads, extra), MLP(d, hidden, extra)]
        self.head = nn.Linear(d, vocab, bias=False)
        m = 2 * layers
        if variant != "baseline":
            self.queries = nn.Parameter(torch.zeros(m, self.rank))
            self.ends = schedule.block_ends(m, min(blocks, m))
        if variant == "projected":
            self.embed_key = nn.Linear(d, self.rank, bias=False)

    def forward(self, tokens):
        e = self.embed(tokens)
        if self.variant == "baseline":
            h = e
            for sub in self.sublayers:
                h = h + sub(rms(h))
            return self.head(rms(h))
        return self.head(rms(self._attnres(e)))

    def _attnres(self, e):
        projected = self.variant == "projected"
        d = self.d
        values = [e]
        keys = [rms(self.embed_key(e))] if projected else None
        x, start = rms(e), 0  # site 0: identity read
        partial_v = partial_k = None
        h = e
        for j, sub in enumerate(self.sublayers, start=1):
            y = sub(x)
            o, k = (y[..., :d], rms(y[..., d:])) if projected else (y, None)
            partial_v = o if partial_v is None else partial_v + o
            if projected:
                partial_k = k if partial_k is None else partial_k + k
            if j - 1 == start:  # first site of a block: phase 1 for its partial sites at once
                end = next(t for t in self.ends if t >= j)
                if end - 1 > start:
                    bank = self.queries[start : end - 1]
                    out1, lse1 = custom_ops.block_read(values, keys, bank)
            c = j - 1 - start
            if j in self.ends:  # block complete: no partial, the block becomes a source
                values.append(partial_v)
                if projected:
                    keys.append(partial_k)
                h, x = self._full_read(values, keys, j)
                partial_v = partial_k = None
                start = j
            else:
                pk = partial_k if projected else None
                q = self.queries[j - 1]
                h, x = custom_ops.merge_partial(out1[c], lse1[c], partial_v, pk, q, emit_norm=True)
        return h

    def _full_read(self, values, keys, j):
        h = custom_ops.depth_read(values, keys, self.queries[j - 1])
        return h, rms(h)


def step_fn(model, opt, tokens, targets):
    def step():
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step
