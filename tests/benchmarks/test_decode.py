"""The decode benchmark on the debug flavor: every figure present, the baseline's own ratios 1,
the cache counted as the model's layers hold it, depth state per step only; the
compiled mode beside the eager one."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode


def test_decode_benchmark_figures():
    res = decode.measure(
        "debug", variants=("baseline", "sliced2_r16", "projected2_r16"), prompt=16, new=3,
        batches=(1, 2), rounds=1, modes=("eager",), progress=lambda _: None, prefills=2,
    )  # fmt: skip
    assert list(res) == ["eager"] and sorted(res["eager"]) == [1, 2]
    for b, rows in res["eager"].items():
        base = rows["baseline"]
        assert base["prefill_ratio"] == 1 and base["decode_ratio"] == 1
        # debug: 2 layers x (k, v) x [B, 16 + 3, 4 heads, 16] fp32
        kv = 2 * 2 * b * 19 * 4 * 16 * 4 / 2**20
        for r in rows.values():
            assert r["kv_cache_mib"] == pytest.approx(kv)
            assert r["decode_ms_median"] > 0 and r["decode_ms_p90"] >= r["decode_ms_median"]
            assert r["decode_tokens_per_s"] > 0 and r["decode_ratio"] > 0
            lo, hi = r["decode_ratio_ci95"]
            assert lo <= r["decode_ratio"] <= hi and len(r["prefill_ratio_ci95"]) == 2
        # a routed forward holds the embedding, the block sums and the partial at once, the
        # baseline only its running sum (and the embedding it started from): more bytes
        assert rows["sliced2_r16"]["prefill_depth_state_mib"] > base["prefill_depth_state_mib"]
        # decode state scales with the step's tokens (B x 1), not the prompt
        ratio = rows["sliced2_r16"]["prefill_depth_state_mib"] * 2**10
        assert rows["sliced2_r16"]["decode_depth_state_kib"] == pytest.approx(ratio / 16)


@pytest.mark.slow
def test_compiled_mode_beside_eager():
    """One model (compiling is most of the cost; CompiledForward's own tests cover the reads)."""
    res = decode.measure(
        "debug", variants=("baseline",), prompt=8, new=2, batches=(1,), rounds=1,
        progress=lambda _: None,
    )  # fmt: skip
    assert list(res) == ["compiled", "eager"]
    for mode, by_batch in res.items():
        row = by_batch[1]["baseline"]
        assert row["decode_ratio"] == 1 and row["warmup_s"] > 0 and row["decode_ms_median"] > 0
        # a compiled graph has no Python depth state to count; the eager path counts it
        assert (row["decode_depth_state_kib"] is None) == (mode == "compiled")
    assert "compiled" in decode.table(res) and "eager" in decode.table(res)


def test_shared_weights_are_the_donors_memory():
    """Every variant reads its weights from the same memory: the P-LR model (most elements) is
    the donor, the others' output projections its fused weights' first rows; queries stay own."""
    names = ("baseline", "sliced2_r16", "projected2_r16")
    models = [decode.Decoder(n, "debug", "cpu").model for n in names]
    donor = dict(models[2].named_parameters())
    decode.share_weights(models)
    for model in models[:2]:
        for name, p in model.named_parameters():
            if decode.routing_parameter(name):
                assert name not in donor or p.data_ptr() != donor[name].data_ptr()
                continue
            d = donor[name]
            assert p.data_ptr() == d.data_ptr() and torch.equal(p, d[: p.shape[0]])
    wo = models[0].layers["0"].attention.wo.weight
    assert wo.shape[0] < donor["layers.0.attention.wo.weight"].shape[0]  # [W^O; W^K] shared


def test_depth_state_counts_shared_storage_once():
    x = torch.zeros(4, 8)
    assert decode._bytes([x, x[1], x.unbind(0)[2], None]) == 4 * 8 * 4


def test_refusals():
    with pytest.raises(ValueError, match="include 'baseline'"):
        decode.measure("debug", variants=("sliced2_r16",), rounds=1)
    with pytest.raises(ValueError, match="max_seq_len 512"):
        decode.measure("debug", variants=("baseline",), prompt=510, new=3, rounds=1)
    assert decode.main(["--variants", "baseline,nonsense"]) == 2
    with pytest.raises(ValueError, match="modes must be a non-empty subset"):
        decode.measure("debug", variants=("baseline",), modes=("jit",), rounds=1)
    with pytest.raises(ValueError, match="prefills must be >= 1"):
        decode.measure("debug", variants=("baseline",), prefills=0, rounds=1)


def test_prefills_take_turns_each_into_a_new_cache(monkeypatch):
    """``prefills=3``: in a round every variant prefills three times, the variants taking turns
    (the order rotating), each fill into its own cache; the round decodes from each variant's
    last fill, which holds the prompt once."""
    calls = []
    start = decode.Decoder.start

    def recording(self, prompt, new, device, mode="eager"):
        run = start(self, prompt, new, device, mode)
        calls.append((self.model.router.variant, run["cache"]))
        return run

    monkeypatch.setattr(decode.Decoder, "start", recording)
    decode.measure(
        "debug", variants=("baseline", "sliced2_r16"), prompt=6, new=2, batches=(1,), rounds=1,
        modes=("eager",), progress=lambda _: None, prefills=3,
    )  # fmt: skip
    rounds = calls[2:]  # after one warm-up run per variant
    order = [v for v, _ in rounds]
    assert order == ["baseline", "sliced", "sliced", "baseline", "baseline", "sliced"]
    assert len({id(c) for _, c in rounds}) == 6
    assert [c.length for _, c in rounds] == [6, 6, 6, 6, 8, 8]  # the last fills decoded 2 steps
