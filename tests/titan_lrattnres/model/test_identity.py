"""One model identity: the fingerprint, the summary, the model arguments and the sweep's key are
all written from ``ModelIdentity`` and read back into it."""

import pytest

from titan_lrattnres.model.registry import ModelIdentity, build_model_config
from titan_lrattnres.training.trainer import model_fingerprint

CASES = [
    dict(variant="baseline"),
    dict(variant="sliced", blocks=2, rank=16),
    dict(variant="attnres", blocks=None),  # Full
    dict(variant="projected", block_layers=1, rank=8),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: k["variant"])
def test_identity_round_trips_through_every_record(kwargs):
    config = build_model_config("debug", **kwargs)
    ident = ModelIdentity.of(config, "debug")
    assert ModelIdentity.from_record(ident.record()) == ident
    rebuilt = build_model_config(**ident.model_args())
    assert ModelIdentity.of(rebuilt, "debug") == ident
    fp = model_fingerprint(config)
    routed = kwargs["variant"] != "baseline"
    # the checkpoint fingerprint's fields as checkpoints have always held them
    assert fp == {
        "dim": 64, "vocab_size": config.vocab_size, "hidden_dim": 192, "num_layers": 2,
        "n_heads": 4, "variant": kwargs["variant"],
        "rank": config.router.rank if routed else None,
        "blocks": config.router.blocks if routed else None,
        "block_layers": config.router.block_layers, "eps": config.router.eps,
    }  # fmt: skip


def test_the_key_names_blocks_and_rank_only_where_they_apply():
    assert ModelIdentity(variant="baseline", blocks=4, rank=32).key() == ("baseline",)
    assert ModelIdentity(variant="attnres", blocks=4, rank=128).key() == ("attnres", 4, None, None)
    assert ModelIdentity(variant="sliced", blocks=4, rank=32).key() == ("sliced", 4, None, 32)
    a = ModelIdentity(variant="sliced", block_layers=3, rank=32)
    assert a.key() != ModelIdentity(variant="sliced", blocks=4, rank=32).key()
