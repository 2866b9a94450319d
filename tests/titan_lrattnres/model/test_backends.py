"""The fused two-phase read path gives the reference model's loss and every gradient."""

import pytest
import torch

VARIANTS = ["attnres", "sliced", "projected"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("blocks", [None, 1, 3, 4])
@pytest.mark.parametrize("backend", ["compiled", "auto"])
def test_fused_backend_matches_reference(build, variant, blocks, backend):
    kw = dict(variant=variant, blocks=blocks, rank=16)
    ref = build(depth_backend="reference", **kw)
    fused = build(depth_backend=backend, **kw)
    fused.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(1))
    _assert_same_loss_and_gradients(ref, fused, tokens)


def _assert_same_loss_and_gradients(ref, fused, tokens):
    """One step of each on ``tokens``: fused's loss and every gradient those of ``ref`` (fp32)."""
    losses = []
    for model in (ref, fused):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_backend_matches_reference_in_bf16(build, variant):
    """bf16 parameters and activations (FSDP's compute dtype on GPU): the two read paths agree to
    bf16 rounding in the loss and every gradient (relative RMS)."""
    kw = dict(variant=variant, blocks=3, rank=16, dtype=torch.bfloat16)
    ref = build(depth_backend="reference", **kw)
    fused = build(depth_backend="compiled", **kw)
    fused.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (ref, fused):
        logits = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=2e-3)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        a, b = q.grad.double(), p.grad.double()
        assert (a - b).norm() <= 0.02 * b.norm() + 1e-6, name  # measured <= 0.0075


@pytest.mark.parametrize("grad", [True, False])
def test_phase1_runs_once_per_block(build, monkeypatch, grad):
    """Each completed source set is read once per block, not once per read site: by the
    forward's ``SourceBank`` in training (on CPU in fp32 the fused kernels, not the ops), by
    ``block_read`` without autograd."""
    import custom_ops

    calls = {"bank": 0, "op": 0}
    read, block_read = custom_ops.SourceBank.read, custom_ops.api.block_read

    def bank_read(*a, **k):
        calls["bank"] += 1
        return read(*a, **k)

    def op(*a, **k):
        calls["op"] += 1
        return block_read(*a, **k)

    monkeypatch.setattr(custom_ops.SourceBank, "read", bank_read)
    monkeypatch.setattr(custom_ops.api, "block_read", op)
    monkeypatch.setattr(custom_ops, "block_read", op)
    model = build("deep_debug", variant="sliced", blocks=8, rank=16, depth_backend="compiled")
    with torch.set_grad_enabled(grad):
        model(torch.randint(0, 4096, (1, 8)))
    # completion points: site 0 and the 8 block ends (the last one for the final read only)
    assert calls == ({"bank": 9, "op": 0} if grad else {"bank": 0, "op": 9})


def _compiled(model, backend: str):
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    class _Dims:  # the one attribute apply_compile reads from ParallelDims
        tp_enabled = False

    apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend),
                  parallel_dims=_Dims)  # fmt: skip
    return model


@pytest.mark.parametrize(
    "variant,blocks,compiler",
    [("sliced", 4, "aot_eager"), ("projected", 3, "aot_eager"), ("attnres", 8, "aot_eager"),
     ("sliced", 4, "inductor"), ("sliced", None, "aot_eager")],
)  # fmt: skip
def test_merges_inside_compiled_sublayers_match_reference(build, variant, blocks, compiler):
    """The compiled path: each merge traced as the reference's maths inside the sublayer that
    reads it (Inductor: fused there), the loss and every gradient those of the reference."""
    torch._dynamo.reset()
    kw = dict(variant=variant, blocks=blocks, rank=16)
    ref = build("deep_debug", depth_backend="reference", **kw)
    fused = _compiled(build("deep_debug", depth_backend="auto", **kw), compiler)
    fused.load_state_dict(ref.state_dict())
    reads, step = [], fused.router.step

    def recording_step(*args):  # what the router hands the next sublayer: a partial to merge?
        h, read = step(*args)
        reads.append(read[1] is not None)
        return h, read

    fused.router.step = recording_step
    tokens = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(2))
    try:
        _assert_same_loss_and_gradients(ref, fused, tokens)
    finally:
        torch._dynamo.reset()
    # every site is finished by the sublayer reading it (the last by the router): a merge with
    # the partial inside a block, a cast at a block end; Full, read in pairs of sites, merges
    # at every odd site (its own sublayer's output) and casts at the even ones
    ends = set(fused.router.ends)
    if blocks is None:
        assert fused.router.reads_pairs
        assert reads == [t % 2 == 1 for t in range(1, 49)]
    else:
        assert reads == [t not in ends for t in range(1, 49)]
