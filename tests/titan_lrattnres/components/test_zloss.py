"""z-loss: the value against a hand computation, training vs validation, the logged split; the
vocabulary-parallel sums (tensor parallel) against the one-process ones, the vocabulary split by
hand over threads; the tensor-parallel checks."""

from __future__ import annotations

import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor

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


# -- vocabulary parallel (tensor parallel): the vocabulary split by hand over threads ------------
class _Ranks:
    """``n`` threads standing in for the ranks of a TP group: ``reduce`` all-reduces a tensor
    elementwise over them (in rank order), as ``zloss._all_reduce`` does over a process group."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=60)
        self.inbox: list = [None] * n
        self.calls: list[str] = []

    def reduce(self, t: torch.Tensor, op: str, rank: int) -> torch.Tensor:
        self.inbox[rank] = t
        self.barrier.wait()
        out = torch.stack(self.inbox).amax(0) if op == "max" else torch.stack(self.inbox).sum(0)
        if rank == 0:
            self.calls.append(op)
        self.barrier.wait()  # every rank has read before the next call writes
        return out


def _vocab_parallel(monkeypatch, logits, labels, ranks: int, g_z: float):
    """Each of ``ranks`` threads holds a contiguous vocabulary shard of ``logits`` and runs
    ``vocab_parallel_ce_and_z``; returns every rank's (ce, z), the gradient of ``ce + g_z * z``
    with respect to the whole logits (the shards' gradients side by side), and the collectives."""
    group = _Ranks(ranks)
    monkeypatch.setattr(zloss, "_all_reduce", lambda t, op, rank: group.reduce(t, op, rank))
    width = logits.shape[-1] // ranks

    def rank_fn(rank: int):
        shard = logits[..., rank * width : (rank + 1) * width].detach().requires_grad_()
        ce, z = zloss.vocab_parallel_ce_and_z(shard, labels, rank * width, rank)
        (grad,) = torch.autograd.grad(ce + g_z * z, shard)
        return ce.detach(), z.detach(), grad

    with ThreadPoolExecutor(ranks) as pool:
        out = [f.result() for f in [pool.submit(rank_fn, r) for r in range(ranks)]]
    return [o[:2] for o in out], torch.cat([o[2] for o in out], -1), group.calls


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_equals_one_process(monkeypatch, ranks, dtype):
    """Sums and logits' gradient of the vocabulary split over ``ranks`` equal ``ce_and_z`` of the
    whole, with ignored labels and padded vocabulary rows (``PAD_LOGIT``; at 4 ranks the last
    shard is all padding). Measured, fp32: sums equal, gradients within 6.9e-7 of the largest
    entry (a few fp32 ulps: the target entries' ``softmax * coef - 1`` cancels; 1.1e-7 relative on
    the sums over 5 seeds); bf16 logits: sums and gradients (after the cast to bf16) equal."""
    from titan_lrattnres.model.model import PAD_LOGIT

    gen = torch.Generator().manual_seed(0)
    vocab, real = 64, 45  # rows 45..63 padding, as the head masks them
    logits = (3 * torch.randn(3, 7, vocab, generator=gen)).to(dtype)
    logits[..., real:] = PAD_LOGIT
    labels = torch.randint(0, real, (3, 7), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[2, 6] = IGNORE_INDEX
    labels[1, 0], labels[1, 1] = 0, real - 1  # the first and the last real row
    g_z = 0.3

    ref_logits = logits.detach().requires_grad_()
    ref_ce, ref_z = zloss.ce_and_z(ref_logits, labels)
    (ref_grad,) = torch.autograd.grad(ref_ce + g_z * ref_z, ref_logits)

    sums, grad, calls = _vocab_parallel(monkeypatch, logits, labels, ranks, g_z)
    assert calls == ["max", "sum"]  # one max and one sum all-reduce, none in the backward
    for ce, z in sums:  # the same on every rank
        torch.testing.assert_close(ce, ref_ce, rtol=1e-6, atol=0)
        torch.testing.assert_close(z, ref_z, rtol=1e-6, atol=0)
    assert grad.dtype == dtype
    assert (grad[..., real:] == 0).all() and (grad[0, :3] == 0).all()  # padding, ignored
    scale = ref_grad.abs().max()
    torch.testing.assert_close(grad.float() / scale, ref_grad.float() / scale, rtol=0, atol=2e-6)


def test_tensor_parallel_checks_the_shard_width(monkeypatch):
    """A logit width that is not the TP share of ``global_vocab_size`` is refused (one line), and
    so is a vocabulary shard outside a tensor-parallel mesh."""
    pred, labels = torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="width 8 outside a tensor-parallel mesh"):
        ZLossCrossEntropy.Config(global_vocab_size=16).build()(pred, labels)
    monkeypatch.setattr(zloss, "spmd_mesh_size", lambda axis: 2)
    for vocab in (None, 12):
        loss_fn = ZLossCrossEntropy.Config(global_vocab_size=vocab).build()
        with pytest.raises(ValueError, match=f"width 8 are not a 1/2 shard .* {vocab} "):
            loss_fn(pred, labels)


def test_tensor_parallel_accepts_the_z_loss_and_sets_its_vocabulary():
    from train_configs.cpu import cpu_smoke_muon

    c = cpu_smoke_muon()
    c.parallelism.tensor_parallel_degree = 2
    assert c.loss.loss_fn.global_vocab_size is None
    c.model_spec.model.update_from_config(config=c)
    assert c.loss.loss_fn.global_vocab_size == c.model_spec.model.lm_head.out_features == 4096
