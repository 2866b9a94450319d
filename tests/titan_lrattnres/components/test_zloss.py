"""z-loss: the value against a hand computation, training vs validation, the logged split."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper

from titan_lrattnres.components import zloss
from titan_lrattnres.components.zloss import ZLossCrossEntropy

LOGITS = [  # [B=1, L=3, V=4]
    [[2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0], [10.0, -5.0, 1.0, 2.0]]
]
LABELS = [[3, 1, IGNORE_INDEX]]


def _by_hand(weight: float) -> tuple[float, float]:
    """(mean CE, mean weight * lse^2) over the valid tokens, with math.* only."""
    ce = z = 0.0
    n = 0
    for row, label in zip(LOGITS[0], LABELS[0]):
        if label == IGNORE_INDEX:
            continue
        lse = math.log(sum(math.exp(x) for x in row))
        ce += lse - row[label]
        z += weight * lse**2
        n += 1
    return ce / n, z / n


def test_training_loss_is_ce_plus_weighted_z_by_hand():
    loss_fn = ZLossCrossEntropy.Config(z_loss_weight=1e-2).build()
    pred, labels = torch.tensor(LOGITS), torch.tensor(LABELS)
    gvt = torch.tensor(2)
    loss, metrics = loss_fn(pred, labels, gvt)
    ce, z = _by_hand(1e-2)
    assert loss.item() == pytest.approx(ce + z, rel=1e-6)
    assert metrics["z_loss/mean"].item() == pytest.approx(z, rel=1e-6)
    assert loss_fn.train_ce.item() == pytest.approx(ce, rel=1e-6)
    # the CE part equals torch's cross-entropy
    ref = torch.nn.functional.cross_entropy(pred[0], labels[0], ignore_index=IGNORE_INDEX)
    assert ce == pytest.approx(ref.item(), rel=1e-6)


def test_gradient_of_the_z_term():
    """d(w * lse^2)/d logits = 2 w lse softmax(logits), per valid token, / global tokens."""
    w = 0.5
    pred = torch.tensor(LOGITS, requires_grad=True)
    labels = torch.tensor(LABELS)
    with_z, _ = ZLossCrossEntropy.Config(z_loss_weight=w).build()(pred, labels, torch.tensor(2))
    (g_with,) = torch.autograd.grad(with_z, pred)
    no_z, _ = ZLossCrossEntropy.Config(z_loss_weight=0.0).build()(pred, labels, torch.tensor(2))
    (g_without,) = torch.autograd.grad(no_z, pred)
    lse = torch.logsumexp(pred.detach(), -1, keepdim=True)
    expected = 2 * w * lse * torch.softmax(pred.detach(), -1) / 2
    expected[0, 2] = 0  # ignored label
    torch.testing.assert_close(g_with - g_without, expected, rtol=1e-5, atol=1e-7)


def test_steps_accumulate_microbatches_and_reset_per_step():
    loss_fn = ZLossCrossEntropy.Config(z_loss_weight=1e-2).build()
    pred, labels = torch.tensor(LOGITS), torch.tensor(LABELS)
    step1 = torch.tensor(4)
    loss_fn(pred, labels, step1)
    loss_fn(pred, labels, step1)  # second microbatch of the same step
    assert loss_fn.train_z.item() == pytest.approx(_by_hand(1e-2)[1], rel=1e-6)
    loss_fn(pred, labels, torch.tensor(2))  # next step: a new token-count tensor
    assert loss_fn.train_z.item() == pytest.approx(_by_hand(1e-2)[1], rel=1e-6)


def test_validation_returns_ce_sum_and_keeps_z_apart():
    loss_fn = ChunkedLossWrapper.Config(
        num_chunks=1, loss_fn=ZLossCrossEntropy.Config(z_loss_weight=1e-2)
    ).build()
    lm_head = torch.nn.Identity()
    loss_fn.set_lm_head(lm_head)
    pred, labels = torch.tensor(LOGITS), torch.tensor(LABELS)
    total, _ = loss_fn(pred, labels)  # what torchtitan's Validator calls
    ce, z = _by_hand(1e-2)
    assert total.item() == pytest.approx(2 * ce, rel=1e-6)  # a sum over the 2 valid tokens
    inner = zloss._ACTIVE
    assert inner.val_tokens.item() == 2
    assert (inner.val_z / inner.val_tokens).item() == pytest.approx(z, rel=1e-6)


def test_dtensor_logits_are_refused():
    class Fake(torch.Tensor):
        device_mesh = None

    loss_fn = ZLossCrossEntropy.Config().build()
    with pytest.raises(NotImplementedError, match="plain local logits"):
        loss_fn(torch.zeros(1, 1, 2).as_subclass(Fake), torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.slow
def test_cpu_smoke_muon_trains_and_logs_ce_and_z_apart(tmp_path):
    """The recipe end to end on CPU (Muon + AdamW + z-loss, 12 steps of the debug model)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from titan_lrattnres.components import data

    root = Path(__file__).resolve().parents[3]
    cache = tmp_path / "data_cache"
    files = data.stdlib_files()
    train = [f for f in files if not data.is_validation(f[0])][:60]
    val = [f for f in files if data.is_validation(f[0])][:8]
    data.build_corpus(data.corpus_dir(cache), train + val, vocab_size=1024)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env[data.CACHE_ENV] = str(cache)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "titan_lrattnres.train", "cpu_smoke_muon", "--dump_folder"]
    cmd += [str(out), "--training.steps", "12", "--checkpoint.no-enable"]
    cmd += ["--validator.freq", "12", "--validator.steps", "2"]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    log = p.stdout + p.stderr
    assert "Optimizer Muon (model_part=0): 10 params" in log
    z_lines = [ln for ln in log.splitlines() if "z_loss:" in ln]
    assert len(z_lines) == 12
    ce, z = (float(x) for x in re.search(r"ce:\s+(\S+)\s+z_loss: (\S+)", z_lines[-1]).groups())
    hist = json.loads((out / "loss_history.json").read_text())
    assert hist[-1]["loss"] == pytest.approx(ce + z, abs=2e-5)  # logged loss = CE + z
    assert 1e-4 < z < 1e-2
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5
    val_ce, val_ce_z = (
        float(x)
        for x in re.search(r"validate step: 12  ce:\s+(\S+)\s+ce \+ z:\s+(\S+)", log).groups()
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] == pytest.approx(val_ce, abs=1e-4)  # validation reports CE
    assert 0 < val_ce_z - val_ce < 1e-2
