"""Tiny deterministic runs for the reproducibility tests, a second or two of training each on
one core: the golden loss curves (``tests/titan_lrattnres/training/test_golden.py``) and 1-vs-2-rank
parity (``test_parity.py``).

``tiny_{baseline,attnres_full,attnres,sliced,projected}``: the ``debug`` flavor (d=64, L=2, so
2L = 4 sublayers), Block N=2 (``attnres_full``: Full), r=16 (attnres: r=d), seq 64 x batch 4,
20 steps, AdamW 3e-3 with 4 warmup steps and linear decay to 0.1x, 2 validation batches at the
end, a checkpoint every 10 steps. The queries learn at 3e-2: they start at zero (every read a
plain mean); at 10x the rate the routing moves away from uniform within the 20 steps, and the
curves answer to the depth maths more (golden/regen.py: what a 1 % logit-scale change does).
"""

from __future__ import annotations

from train_configs.common import make_config

TINY_VARIANTS = {  # name -> (variant, blocks)
    "tiny_baseline": ("baseline", None),
    "tiny_attnres_full": ("attnres", None),
    "tiny_attnres": ("attnres", 2),
    "tiny_sliced": ("sliced", 2),
    "tiny_projected": ("projected", 2),
}


def _tiny(name: str):
    variant, blocks = TINY_VARIANTS[name]
    return make_config(
        name=name,
        flavor="debug",
        variant=variant,
        blocks=blocks,
        rank=16,
        seq_len=64,
        local_batch_size=4,
        steps=20,
        lr=3e-3,
        lr_query=3e-2,
        warmup_steps=4,
        decay_ratio=None,
        min_lr_factor=0.1,
        val_steps=2,
        checkpoint_interval=10,
    )


def tiny_baseline():
    return _tiny("tiny_baseline")


def tiny_attnres_full():
    return _tiny("tiny_attnres_full")


def tiny_attnres():
    return _tiny("tiny_attnres")


def tiny_sliced():
    return _tiny("tiny_sliced")


def tiny_projected():
    return _tiny("tiny_projected")


CONFIGS = {
    f.__name__: f
    for f in (tiny_baseline, tiny_attnres_full, tiny_attnres, tiny_sliced, tiny_projected)
}
