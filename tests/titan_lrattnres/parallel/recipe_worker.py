"""``parallel_worker.py`` on the paper's recipe: ``python recipe_worker.py MODEL [trainer CLI ...]``
trains ``cpu_smoke_muon`` (``train_configs.cpu``: Muon + AdamW as ``recipe_param_groups`` routes
them, Polar Express in fp32, the momentum schedule, the chunked z-loss with its z part logged
apart) with the model ``MODEL``, and two changes: each MLP's ``[w1; w3]`` orthogonalised as one
matrix (``fuse_mlp_input``, the paper's fused ``fc1``), and the z-loss weight ``WEIGHT``, not the
paper's 1e-5: at 1e-5 the z part of the loss and of every gradient would sit below the parity
tolerance."""

from __future__ import annotations

import sys

WEIGHT = 1e-2


def recipe():
    """The runs' base config (importing this module changes nothing: the tests check it)."""
    from train_configs.cpu import cpu_smoke_muon

    return cpu_smoke_muon(z_loss_weight=WEIGHT, fuse_mlp_input=True)


if __name__ == "__main__":
    from tests.titan_lrattnres import parallel_worker  # sets up the CPU backend and the hooks

    sys.exit(parallel_worker.main(sys.argv[1:], base=recipe))
