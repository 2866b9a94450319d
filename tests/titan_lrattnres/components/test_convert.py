"""Checkpoints from before the per-site query layout (``titan_lrattnres.components.convert``).

An old-layout checkpoint (``router.query_bank [2L, r]`` and its optimiser entries) is made from a
real run's step-2 checkpoint by the inverse rewrite; then: the trainer refuses it by name with
the command, the evaluation tools read it, and ``python -m titan_lrattnres.convert`` turns it
into a folder from which training resumes with the uninterrupted run's losses, bitwise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.titan_lrattnres.trainer_runs import ROOT, launch
from titan_lrattnres.components import convert, integrity
from titan_lrattnres.evaluation.inference import load_model

SITES = 4  # cpu_smoke: debug flavor, L=2


def _merge_queries(state: dict) -> dict:
    """The inverse of ``convert.split_queries``: per-site entries back into one bank."""
    out, banks = {}, {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _merge_queries(value)
            continue
        parts = key.split("router.query_")
        if len(parts) == 2 and parts[1].split(".")[0].isdigit():
            site, _, rest = parts[1].partition(".")
            new = parts[0] + convert.OLD + ("." + rest if rest else "")
            banks.setdefault(new, {})[int(site)] = value
        else:
            out[key] = value
    for key, by_site in banks.items():
        assert sorted(by_site) == list(range(1, SITES + 1)), key
        first = by_site[1]
        rows = isinstance(first, torch.Tensor) and first.ndim >= 1
        out[key] = torch.stack([by_site[t] for t in sorted(by_site)]) if rows else first
    return out


def _to_old_layout(src: Path, dst: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = dst.parent / "flat.pt"
        dcp_to_torch_save(str(src), str(flat))
        torch.save(_merge_queries(torch.load(flat, weights_only=False)), flat)
        torch_save_to_dcp(str(flat), str(dst))
        flat.unlink()
    integrity.record(dst)


def _stored(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def _run(name: str, folder: Path, args: list[str]) -> dict:
    return {"name": name, "argv": ["cpu_smoke", "--dump_folder", str(folder), *args]}


def test_split_queries_rows_and_copies():
    state = {
        "router.query_bank": torch.arange(8.0).reshape(4, 2),
        "optimizer": {"state.router.query_bank.step": torch.tensor(3.0), "x": 1},
        "param_groups.router.query_bank.lr": 0.1,
    }
    out = convert.split_queries(state, sites=4)
    assert torch.equal(out["router.query_3"], torch.tensor([4.0, 5.0]))
    assert out["optimizer"]["state.router.query_2.step"] == 3 and out["optimizer"]["x"] == 1
    assert {out[f"param_groups.router.query_{t}.lr"] for t in range(1, 5)} == {0.1}
    with pytest.raises(ValueError, match=r"router.query_bank: \(4, 2\) has no 5 query rows"):
        convert.split_queries(state, sites=5)


def test_old_checkpoint_refused_read_converted_and_resumed(env, tmp_path):
    common = ["--training.steps", "4", "--checkpoint.interval", "2", "--validator.no-enable"]
    common += ["--debug.seed", "0", "--debug.deterministic"]
    full = tmp_path / "full"
    runs, _ = launch([_run("full", full, common)], tmp_path / "l1", env)
    assert runs["full"]["rc"] == 0, runs["full"]["output"][-3000:]

    # the same run, stopped after step 2 with its checkpoint in the old layout
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copy(full / "checkpoint" / "model_fingerprint.json", resumed / "checkpoint")
    step2 = resumed / "checkpoint" / "step-2"
    _to_old_layout(full / "checkpoint" / "step-2", step2)
    assert convert.OLD in _stored(step2) and not any("query_1" in k for k in _stored(step2))

    with pytest.raises(convert.OldLayoutError, match=r"python -m titan_lrattnres.convert"):
        convert.refuse_old_layout(step2)
    new, args = load_model(full / "checkpoint" / "step-2")  # its arguments: the run's summary
    old, _ = load_model(step2, model_args=args)  # evaluation tools read the old layout as is
    for (name, p), (_, q) in zip(new.named_parameters(), old.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    cmd = [sys.executable, "-m", "titan_lrattnres.convert", str(resumed)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "converted in place (4 read sites" in p.stdout
    assert (resumed / "checkpoint" / "step-2.query_bank").is_dir()  # the original, kept
    assert _stored(step2) == _stored(full / "checkpoint" / "step-2")
    integrity.check(step2)

    runs, _ = launch([_run("resumed", resumed, common)], tmp_path / "l2", env)
    assert runs["resumed"]["rc"] == 0, runs["resumed"]["output"][-3000:]
    got = json.loads((resumed / "loss_history.json").read_text())
    want = json.loads((full / "loss_history.json").read_text())
    assert [h["step"] for h in got] == [3, 4]
    assert [h["loss"] for h in got] == [h["loss"] for h in want[2:]]  # bitwise
