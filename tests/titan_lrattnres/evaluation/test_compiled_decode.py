"""The compiled decode path (``generate.CompiledForward``): the same logits and greedy tokens as
the eager cached path and the uncached forward, one graph for every decode step, clear errors."""

import contextlib
import gc

import pytest
import torch

from custom_ops.ops import own_code
from tests.titan_lrattnres._tiny import trained
from titan_lrattnres.evaluation import generate as gen

CONFIGS = [
    pytest.param("baseline", None, id="baseline"),
    pytest.param("projected", 2, id="projected-block2"),
    pytest.param("sliced", None, id="sliced-full"),
    pytest.param("attnres", 3, id="attnres-block3"),
]


@pytest.mark.parametrize("variant,blocks", CONFIGS)
def test_static_cache_equals_the_growing_cache(variant, blocks):
    """What the compiled graphs run, eager: writes at a tensor position, attention over every
    row under the mask of the filled ones; same logits as the cache that grows."""
    model, _ = trained(variant, blocks, depth_backend="auto")
    seq = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    eager, static = gen.KVCache(model, 2, 12), gen.KVCache(model, 2, 20, static=True)
    for a, b in ((0, 5), (5, 8), (8, 9), (9, 10)):
        want = gen.forward_cached(model, seq[:, a:b], eager)
        torch.testing.assert_close(
            gen.forward_cached(model, seq[:, a:b], static), want, rtol=1e-5, atol=1e-5
        )
    assert static.length == 10 and int(static.pos) == 10


@pytest.mark.slow
def test_compiled_decode_equals_eager_and_uncached():
    """Compiled (a few minutes on 2 cores, so one variant: projected keys with blocks, every
    read and key path of the reference backend the graphs are traced from)."""
    model, _ = trained("projected", 2, depth_backend="auto")
    compiled = gen.CompiledForward(model)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    # logits: prefill, a chunk after a prefix, single tokens, against the eager cache
    seq = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    # generate's own cache size below: one decode graph for the whole test
    eager = gen.KVCache(model, 2, 16)
    static = gen.KVCache(model, 2, gen.STATIC_ROWS, static=True)
    for a, b in ((0, 5), (5, 8), (8, 9), (9, 10), (10, 11)):
        want = gen.forward_cached(model, seq[:, a:b], eager)
        got = compiled(seq[:, a:b], static)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert static.length == eager.length == 11 and int(static.pos) == 11
    assert model.router.backend == "auto"  # the reads ran as the reference only inside
    # greedy tokens: compiled == uncached forward; every later step reuses the one decode graph
    first = gen.generate(model, prompt, 2, compiled=compiled)
    kept = compiled.cache(2, gen.STATIC_ROWS)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = gen.generate(model, prompt, 10, compiled=compiled)
    assert compiled.cache(2, gen.STATIC_ROWS) is kept  # both calls used it
    assert torch.equal(out[:, :7], first)
    assert torch.equal(out, gen.generate(model, prompt, 10, use_cache=False))


def test_generate_reuses_one_static_cache_per_size():
    """``CompiledForward.cache``: the same cache (same memory: a CUDA graph recorded on it
    replays) for the same size, emptied; another size, another cache. The compiled test above
    generates twice through it, tokens exact both times."""
    model, _ = trained("sliced", 2, steps=0)
    compiled = gen.CompiledForward(model)
    cache = compiled.cache(2, 8)
    gen.forward_cached(model, torch.ones(2, 3, dtype=torch.long), cache)
    assert cache.length == 3 and any(bool(k.any()) for k in cache.k.values())
    again = compiled.cache(2, 8)
    assert again is cache and again.length == 0 and int(again.pos) == 0 and again.static
    assert not any(bool(t.any()) for t in (*again.k.values(), *again.v.values()))
    assert compiled.cache(1, 8) is not cache and compiled.cache(2, 16) is not cache


def test_compiled_decode_refuses_what_it_cannot_run():
    model, _ = trained("sliced", 2, steps=0)
    other, _ = trained("sliced", 2, steps=0)
    compiled = gen.CompiledForward(model)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="static=True"):
        compiled(tokens, gen.KVCache(model, 1, 4))
    full = gen.KVCache(model, 1, 4, static=True)
    full.advance(4)
    with pytest.raises(ValueError, match="KV cache full: 5 > max_len 4"):
        compiled(tokens, full)
    with pytest.raises(ValueError, match="a CompiledForward of model"):
        gen.generate(other, tokens, 2, compiled=compiled)
    with pytest.raises(ValueError, match="use_cache=True"):
        gen.generate(model, tokens, 2, compiled=compiled, use_cache=False)


def test_each_compiled_forward_gets_code_objects_of_its_own():
    """torch.compile keeps graphs per code object: distinct ones keep each model's guard checks
    to its own graphs; the copies compute what the function does."""

    def plus(x, y=2):
        return x + y

    a, b = own_code(plus), own_code(plus)
    assert len({id(plus.__code__), id(a.__code__), id(b.__code__)}) == 3
    assert a.__code__.co_code == plus.__code__.co_code
    assert a(1, 3) == plus(1, 3) == 4 and a(1) == 3


def test_guards_are_skipped_only_after_a_guarded_step_of_the_same_shape(monkeypatch):
    """``guards=False`` skips dynamo's guards (``set_stance(skip_guard_eval_unsafe=True)``)
    only for a one-token step right after a guarded one on the same cache with tokens of the
    same shape, dtype and device: a step that could need another graph runs its guards. The
    graphs are the eager function here (what they compute is tested above); the logits match
    the guarded path's."""
    model, _ = trained("sliced", 2, steps=0)
    compiled = gen.CompiledForward(model)
    compiled.decode = compiled.prefill = gen._forward_cached
    skipped = []

    def stance(mode="default", *, skip_guard_eval_unsafe=False):
        skipped.append(skip_guard_eval_unsafe)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.compiler, "set_stance", stance)

    def step(tokens, cache, guards):
        n = len(skipped)
        logits = compiled(tokens, cache, guards=guards)
        return logits, skipped[n:] == [True]

    one = torch.ones(2, 1, dtype=torch.long)
    cache, other = compiled.cache(2, 16), gen.KVCache(model, 2, 16, static=True)
    eager = gen.KVCache(model, 2, 16)
    assert not step(torch.ones(2, 3, dtype=torch.long), cache, False)[1]  # a prefill
    gen.forward_cached(model, torch.ones(2, 3, dtype=torch.long), eager)
    assert not step(one, cache, False)[1]  # the first step after it
    assert not step(one, cache, True)[1]  # guards asked for
    logits, trusted = step(one, cache, False)
    assert trusted  # the same cache and tokens as the guarded step before
    for _ in range(3):
        want = gen.forward_cached(model, one, eager)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert not step(one, other, False)[1]  # another cache
    assert not step(torch.ones(1, 1, dtype=torch.long), compiled.cache(1, 16), False)[1]
    assert not step(one.int(), cache, False)[1]  # another dtype
    assert step(one.int(), cache, False)[1]


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gen.gc_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with gen.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_generate_decodes_with_the_collector_paused(monkeypatch):
    """Each step runs with the collector off; it is back on afterwards."""
    model, _ = trained("sliced", 2, steps=0)
    seen = []
    forward = gen.forward_cached

    def recording(*args):
        seen.append(gc.isenabled())
        return forward(*args)

    monkeypatch.setattr(gen, "forward_cached", recording)
    gen.generate(model, torch.ones(1, 3, dtype=torch.long), 4)
    assert seen == [False] * 4 and gc.isenabled()
