"""Write faults (no space, a quota, a read-only folder) end in one line naming the path, what was
written and the last complete checkpoint; nothing complete is damaged; the free-space warning.
The trainer runs with a full disk are in ``training/test_preemption_runs.py``."""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException

from tests.titan_lrattnres._tiny import checkpointer
from titan_lrattnres.components import faults, integrity
from titan_lrattnres.training import summary


def _oserror(code: int, path: str = "/x/f") -> OSError:
    return OSError(code, os.strerror(code), path)


@pytest.mark.parametrize(
    "error, reason",
    [
        (_oserror(errno.ENOSPC), "No space left on device (ENOSPC)"),
        (_oserror(errno.EDQUOT), "Disk quota exceeded (EDQUOT)"),
        (_oserror(errno.EROFS), "Read-only file system (EROFS)"),
        (RuntimeError("[enforce fail] PytorchStreamWriter: file write failed"), "a write failed"),
    ],
)
def test_write_faults_are_recognised(error, reason):
    assert faults.write_fault(error)[0].startswith(reason)


def test_wrapped_faults_are_found():
    wrapped = CheckpointException("save failed", {1: (_oserror(errno.ENOSPC), None)})
    assert faults.write_fault(wrapped) == ("No space left on device (ENOSPC)", "/x/f")
    try:
        try:
            raise _oserror(errno.EDQUOT)
        except OSError as e:
            raise RuntimeError("writer died") from e
    except RuntimeError as e:
        assert faults.write_fault(e)[0] == "Disk quota exceeded (EDQUOT)"


@pytest.mark.parametrize("error", [ValueError("x"), _oserror(errno.ENOENT), KeyboardInterrupt()])
def test_other_errors_are_no_write_fault(error):
    assert faults.write_fault(error) is None
    with pytest.raises(type(error)), faults.writing("x", "/p"):
        raise error


def test_the_line_names_path_what_checkpoint_and_how_to_resume():
    line = faults.fault_message(_oserror(errno.EROFS, "/r/ck/step-4/__0_0.distcp"), "checkpoint",
                                "/r/ck/step-4", "/r/ck/step-2")  # fmt: skip
    assert line == (
        "could not write checkpoint /r/ck/step-4: Read-only file system (EROFS) "
        "(/r/ck/step-4/__0_0.distcp); the last complete checkpoint is /r/ck/step-2; make the "
        "folder writable (or pass another --dump_folder), then rerun the same command to resume"
    )
    done = faults.fault_message(_oserror(errno.ENOSPC, "/r/loss.png"), "the loss plot",
                                "/r/loss.png", None, resume=False)  # fmt: skip
    assert done == (
        "could not write the loss plot /r/loss.png: No space left on device (ENOSPC); training "
        "has finished and no checkpoint is complete; free space for the run's other files"
    )
    assert "\n" not in line + done


def test_atomic_json_leaves_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    integrity.write_json(path, {"a": 1})

    def full(fd):
        raise _oserror(errno.ENOSPC)

    monkeypatch.setattr(integrity.os, "fsync", full)
    with pytest.raises(OSError):
        integrity.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.fixture
def full_disk_at(monkeypatch):
    """``full_disk_at(name)``: DCP's writes into a folder ``name`` raise ENOSPC."""
    original = dcp_fs.FileSystem.create_stream

    def install(name: str):
        @contextlib.contextmanager
        def stream(self, path, mode):
            if name in str(path) and "w" in mode:
                raise _oserror(errno.ENOSPC, str(path))
            with original(self, path, mode) as s:
                yield s

        monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", stream)

    return install


def test_a_failed_save_is_one_line_and_the_complete_one_stays(tmp_path, full_disk_at):
    ckpt = checkpointer(tmp_path, interval=2)
    folder = tmp_path / "checkpoint"
    assert ckpt.save(2)
    full_disk_at("step-4")
    with pytest.raises(faults.WriteFaultError) as e:
        ckpt.save(4)
    assert str(e.value).startswith(
        f"could not write checkpoint {folder}/step-4: No space left on device (ENOSPC)"
    )
    assert f"the last complete checkpoint is {folder}/step-2; free space" in str(e.value)
    assert integrity.interrupted(folder / "step-4") is not None  # marked, never mistaken
    assert integrity.problem(folder / "step-2") is None
    ckpt.close()


@pytest.fixture
def world_of_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # async saves need one
    yield
    dist.destroy_process_group()


def test_save_now_saves_any_step_once_and_restores_the_policy(world_of_one, tmp_path):
    ckpt = checkpointer(tmp_path, interval=5, async_mode="async")
    folder = tmp_path / "checkpoint"
    assert ckpt.save_now(3) == f"{folder}/step-3"
    assert integrity.problem(folder / "step-3") is None  # synchronous and recorded
    assert (ckpt.interval, ckpt.async_mode.value) == (5, "async")
    assert ckpt.save(5)  # an interval save (async), then preempted at the same step
    assert ckpt.save_now(5) == f"{folder}/step-5"
    assert integrity.problem(folder / "step-5") is None  # waited for and recorded, not redone
    ckpt.close()


def test_low_free_space_warns_with_both_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "free_bytes", lambda folder: 3 << 20)
    line = faults.low_space_warning(str(tmp_path / "ck"), 10 << 20)
    assert line.startswith(f"only 3.0 MiB free where checkpoints go ({tmp_path}/ck)")
    assert "one checkpoint needs about 10.0 MiB" in line
    assert faults.low_space_warning(str(tmp_path), 1 << 20) is None
    assert faults.free_bytes(str(tmp_path / "not" / "yet")) > 0  # the nearest existing parent


def test_checkpoint_size_counts_parameters_and_optimiser_state():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    params = (8 * 4 + 4) * 4
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert faults.checkpoint_bytes([model], [opt]) == params + states
    assert states >= 2 * params  # exp_avg and exp_avg_sq


def test_summary_write_faults_name_the_file(tmp_path, monkeypatch):
    trainer = SimpleNamespace(config=SimpleNamespace(dump_folder=str(tmp_path)), history=[])
    monkeypatch.setattr(summary, "build_summary", lambda t: {"config": "c", "variant": "v"})
    real_open = builtins.open

    def quota_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("loss_history.json") and "w" in mode:
            raise _oserror(errno.EDQUOT, str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", quota_open)
    with pytest.raises(faults.WriteFaultError) as e:
        summary.write_summary(trainer, "/r/checkpoint/step-9")
    assert str(e.value) == (
        f"could not write the loss history {tmp_path}/loss_history.json: Disk quota exceeded "
        "(EDQUOT); training has finished and the last complete checkpoint is "
        "/r/checkpoint/step-9; free space within your quota for the run's other files"
    )
    assert json.loads((tmp_path / "summary.json").read_text())["config"] == "c"
