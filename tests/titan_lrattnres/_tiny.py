"""Small objects the tests share: a tiny model trained a few steps, a checkpoint manager."""

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
        assert any(q.abs().max() > 0 for q in model.depth_queries())  # no longer uniform
    return model.eval(), args


def checkpointer(folder=None, **config):
    """An ``LRAttnResCheckpointManager`` saving a small linear layer under ``folder`` (disabled
    without one); ``config``: its Config's fields."""
    from titan_lrattnres.components.checkpoint import LRAttnResCheckpointManager

    config = {
        "enable": folder is not None,
        "keep_latest_k": 0,
        "last_save_model_only": False,
        **config,
    }
    return LRAttnResCheckpointManager.Config(**config).build(
        dataloader=None,
        model_parts=[torch.nn.Linear(4, 4)],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(folder or ""),
    )
