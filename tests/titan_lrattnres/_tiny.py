"""A tiny model trained a few steps, shared by the export and generation tests."""

import torch

from titan_lrattnres.evaluation.inference import build_model


def trained(variant, blocks, depth_backend="reference", steps=3, seed=0, vocab_size=256):
    """A tiny model trained a few AdamW steps on random tokens (non-trivial queries)."""
    torch.manual_seed(seed)
    args = dict(flavor="debug", variant=variant, blocks=blocks, rank=16, vocab_size=vocab_size)
    model = build_model(args, depth_backend=depth_backend).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    data = torch.randint(0, vocab_size, (4, 33))
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    if variant != "baseline" and steps:
        assert any(q.abs().max() > 0 for q in model.router.query_params())  # no longer uniform
    return model.eval(), args
