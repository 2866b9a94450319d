"""``recompute_reads``: with activation checkpointing each read site keeps no phase-1 output for
its backward (recomputed there from the sources it keeps anyway); loss and every gradient as
without it, and fewer bytes saved for the backward by about one fp32 ``[T, d]`` per site."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from titan_lrattnres.model.registry import build_model_config

CASES = [  # (variant, blocks, block_layers)
    ("sliced", 2, None),
    ("projected", 3, None),
    ("attnres", 2, None),
    ("sliced", None, 1),
    ("projected", 4, None),  # Full at L=2: every sublayer a block end
]
BACKENDS = ["auto", "compiled"]


def _step(variant, blocks, block_layers, backend, recompute, tokens):
    schedule = {"blocks": blocks} if block_layers is None else {"block_layers": block_layers}
    config = build_model_config(
        "debug", variant=variant, rank=16, depth_backend=backend, **schedule
    )
    config.router.recompute_reads = recompute
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    for name, p in model.named_parameters():  # non-zero queries: the weights depend on them
        if name.startswith("router.query_"):
            p.data.normal_(generator=torch.Generator().manual_seed(len(name)))
    saved = []

    def pack(t):
        saved.append(t.untyped_storage())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    nbytes = sum({s.data_ptr(): s.nbytes() for s in saved}.values())
    return loss.detach(), grads, nbytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant, blocks, block_layers", CASES)
def test_same_loss_and_gradients_fewer_saved_bytes(variant, blocks, block_layers, backend):
    tokens = torch.randint(0, 4096, (2, 37), generator=torch.Generator().manual_seed(1))
    loss0, grads0, kept0 = _step(variant, blocks, block_layers, backend, False, tokens)
    loss1, grads1, kept1 = _step(variant, blocks, block_layers, backend, True, tokens)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name, g in grads0.items():
        err = ((g - grads1[name]).norm() / g.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, (name, err)  # the sources' gradients sum in another order
    sites = 4  # debug flavor: L = 2
    ends = sites if block_layers is None and blocks >= sites else None
    phase1 = tokens.numel() * 64 * 4  # one fp32 [T, d] phase-1 output
    if ends is None:  # Block: every site past a block end kept one
        assert kept0 - kept1 >= phase1, (kept0, kept1)
    else:  # Full: no site merges a partial, nothing to drop
        assert kept1 <= kept0


def test_the_model_config_turns_it_on_with_activation_checkpointing():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from train_configs.cpu import cpu_smoke

    c = cpu_smoke()
    c.model_spec.model.update_from_config(config=c)
    assert c.activation_checkpoint is None and not c.model_spec.model.router.recompute_reads
    c = cpu_smoke()
    c.activation_checkpoint = SelectiveAC.Config()
    c.model_spec.model.update_from_config(config=c)
    assert c.model_spec.model.router.recompute_reads
