"""KV-cached generation: exact against the full forward, for every variant."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan_lrattnres._tiny import trained
from titan_lrattnres.evaluation import generate as gen

CONFIGS = [
    pytest.param("baseline", None, id="baseline"),
    pytest.param("attnres", None, id="attnres-full"),
    pytest.param("attnres", 2, id="attnres-block2"),
    pytest.param("sliced", None, id="sliced-full"),
    pytest.param("sliced", 3, id="sliced-block3"),
    pytest.param("projected", None, id="projected-full"),
    pytest.param("projected", 2, id="projected-block2"),
]


@pytest.mark.parametrize("variant,blocks", CONFIGS)
def test_cached_logits_match_full_forward(variant, blocks):
    model, _ = trained(variant, blocks)
    seq = torch.randint(0, 256, (2, 12))
    full = model(seq)
    cache = gen.KVCache(model, batch=2, max_len=12)
    # prefill 5, one chunk of 3 after a prefix (masked path), then one token at a time
    pieces = [gen.forward_cached(model, seq[:, :5], cache)]
    pieces.append(gen.forward_cached(model, seq[:, 5:8], cache))
    for i in range(8, 12):
        pieces.append(gen.forward_cached(model, seq[:, i : i + 1], cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("variant,blocks", CONFIGS)
def test_greedy_cached_equals_uncached(variant, blocks):
    model, _ = trained(variant, blocks)
    prompt = torch.randint(0, 256, (2, 4))
    a = gen.generate(model, prompt, 12, use_cache=True)
    b = gen.generate(model, prompt, 12, use_cache=False)
    assert a.shape == (2, 16)
    assert torch.equal(a, b)
    assert torch.equal(a[:, :4], prompt)


def test_fused_depth_backend_decodes_like_reference():
    ref, _ = trained("sliced", 3)
    fused, _ = trained("sliced", 3)
    fused.set_depth_backend("auto")
    prompt = torch.randint(0, 256, (1, 5))
    assert torch.equal(gen.generate(ref, prompt, 10), gen.generate(fused, prompt, 10))


def test_sampling_is_seeded_and_top_k_restricts():
    model, _ = trained("sliced", 2)
    prompt = torch.randint(0, 256, (1, 3))
    a = gen.generate(model, prompt, 8, temperature=1.0, top_k=5, seed=1)
    b = gen.generate(model, prompt, 8, temperature=1.0, top_k=5, seed=1)
    assert torch.equal(a, b)
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    draws = {
        gen.sample_next(logits, 1.0, 2, torch.Generator().manual_seed(s)).item() for s in range(50)
    }
    assert draws == {1, 3}
    assert gen.sample_next(logits, 0.0, None).item() == 1


def test_too_long_is_refused():
    model, _ = trained("sliced", 2, steps=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.generate(model, torch.zeros(1, 500, dtype=torch.long), 20)


def test_cli_from_dcp_checkpoint(tmp_path, capsys):
    model, args = trained("projected", 2)
    run = tmp_path / "run"
    dcp.save(model.state_dict(), checkpoint_id=str(run / "checkpoint" / "step-3"))
    (run / "model_args.json").write_text(json.dumps(args))
    prompt = [5, 7, 11]
    gen.main(["--run", str(run), "--prompt", "5,7,11", "--token-ids", "--max-new-tokens", "6"])
    ids = [int(x) for x in capsys.readouterr().out.split()]
    expected = gen.generate(model, torch.tensor([prompt]), 6)[0].tolist()
    assert ids == expected
