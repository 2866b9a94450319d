"""Preemption and full disks end to end (subprocesses, ``cpu_smoke`` on the tiny corpus): a
signal at a chosen step saves that step, logs one line and exits 75, in 1 process and in 2
FSDP2 ranks on gloo; the rerun's curve and final state equal an uninterrupted run's, bitwise; a
save that hits ENOSPC ends in one line and the next run resumes from the last complete
checkpoint; a save that outlasts the grace period is left unfinished.

The driver sends the signal from inside the chosen step (``SIGNAL_AT``, to rank ``SIGNAL_RANK``
only) and simulates a full disk with a DCP stream that raises ENOSPC (``FULL_AT``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests import forkserver
from titan_lrattnres.components import integrity

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
STEPS = ["--training.steps", "12", "--checkpoint.interval", "5"]
DETERMINISTIC = ["--debug.seed", "0", "--debug.deterministic", "--validator.no-enable"]

DRIVER = textwrap.dedent("""
    import contextlib, errno, os, signal, sys, time
    from titan_lrattnres.training import cpu
    cpu.apply()
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from titan_lrattnres.training.trainer import LRAttnResTrainer
    get = lambda k: int(os.environ.get(k, "-1"))
    fwd_bwd, create_stream = LRAttnResTrainer.forward_backward_step, dcp_fs.FileSystem.create_stream

    def step(self, **kwargs):
        if self.step == get("SIGNAL_AT") and get("RANK") == max(get("SIGNAL_RANK"), 0):
            os.kill(os.getpid(), signal.SIGTERM)
        return fwd_bwd(self, **kwargs)

    class Full:  # a disk that takes 4 KiB of a file, then reports ENOSPC
        def __init__(self, raw, path):
            self.raw, self.path, self.left = raw, str(path), 4096
        def write(self, b):
            if len(b) > self.left:
                self.raw.write(bytes(b)[: self.left])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            self.left -= len(b)
            return self.raw.write(b)
        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def stream(self, path, mode):
        with create_stream(self, path, mode) as raw:
            if f"step-{get('FULL_AT')}" in str(path) and "w" in mode:
                raw = Full(raw, path)
            if f"step-{get('SLOW_AT')}" in str(path):
                time.sleep(30)
            yield raw

    LRAttnResTrainer.forward_backward_step = step
    dcp_fs.FileSystem.create_stream = stream
    if get("FREE_BYTES") >= 0:
        from titan_lrattnres.components import faults
        faults.free_bytes = lambda folder: get("FREE_BYTES")
    from titan_lrattnres.train import main
    sys.exit(main(sys.argv[1:]))
""")


def _run(cmd, env, **extra) -> subprocess.CompletedProcess:
    """``cmd`` with the driver's variables ``extra``; forked from the tests' pre-imported server
    (``tests/forkserver.py``) but under torchrun, whose own report the tests read."""
    env = {**env, **{k: str(v) for k, v in extra.items()}}
    if "torch.distributed.run" in cmd:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return forkserver.run(cmd, env=env, cwd=ROOT, timeout=300, run_time=extra)


def _train(driver: Path, out: Path, *args, nproc: int = 1) -> list[str]:
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend",
                   "c10d", "--rdzv_endpoint", "localhost:0"]  # fmt: skip
    return [*launch, str(driver), "cpu_smoke", "--dump_folder", str(out), *args]


def _history(folder: Path) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((folder / "loss_history.json").read_text())}


def _state(step_dir: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = step_dir.parent.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, dest)
    return torch.load(dest, weights_only=False)


def _ok(p: subprocess.CompletedProcess, rc: int = 0) -> str:
    assert p.returncode == rc, (p.returncode, p.stdout[-3000:], p.stderr[-4000:])
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("driver") / "driver.py"
    path.write_text(DRIVER)
    return path


@pytest.fixture(scope="module")
def reference(env, driver, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run (checkpoints at 5, 10 and 12)."""
    out = tmp_path_factory.mktemp("reference")
    _ok(_run(_train(driver, out, *STEPS, *DETERMINISTIC), env))
    return out


def test_a_signal_saves_the_step_and_the_rerun_is_bitwise(env, driver, reference, tmp_path):
    cmd = _train(driver, tmp_path, *STEPS, *DETERMINISTIC)
    log = _ok(_run(cmd, env, SIGNAL_AT=7), rc=75)
    ckpt = tmp_path / "checkpoint"
    line = f"preempted at step 7: saved {ckpt}/step-7; rerun the same command to resume"
    assert log.count(line) == 1, log[-3000:]
    assert "Traceback" not in log
    assert integrity.problem(ckpt / "step-7") is None  # complete, recorded
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert marker == {"step": 7, "checkpoint": f"{ckpt}/step-7", "signal": "SIGTERM"}

    log = _ok(_run(cmd, env))  # the same command again
    assert f"Loading the checkpoint from {ckpt}/step-7" in log
    assert not (tmp_path / "preempted.json").exists()
    resumed, ref = _history(tmp_path), _history(reference)
    assert sorted(resumed) == list(range(8, 13))
    assert {s: ref[s] for s in resumed} == resumed  # bitwise
    a, b = _state(ckpt / "step-12"), _state(reference / "checkpoint" / "step-12")
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 10 and all(torch.equal(a[k], b[k]) for k in tensors)


def test_two_ranks_agree_on_the_step_when_one_is_signalled(env, driver, tmp_path):
    """Only rank 1 gets SIGTERM (in step 3): both finish step 3, save it together and exit 75
    (torchrun reports the workers' code)."""
    args = ("--training.steps", "6", "--checkpoint.interval", "5",
            "--parallelism.data_parallel_shard_degree", "2", *DETERMINISTIC)  # fmt: skip
    cmd = _train(driver, tmp_path, *args, nproc=2)
    log = _ok(_run(cmd, env, SIGNAL_AT=3, SIGNAL_RANK=1), rc=1)
    ckpt = tmp_path / "checkpoint"
    line = f"preempted at step 3: saved {ckpt}/step-3; rerun the same command to resume"
    assert log.count(line) == 1, log[-4000:]
    assert "a signal to another rank received: step 3 has finished" in log  # rank 0's view
    assert "exitcode  : 75" in log  # torchrun's report of the workers
    assert integrity.problem(ckpt / "step-3") is None
    assert json.loads((tmp_path / "preempted.json").read_text())["step"] == 3
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-3"]


def test_torchrun_forwards_its_sigterm_and_the_ranks_save(env, driver, tmp_path):
    """The launcher gets the signal (as from a scheduler): torchrun passes SIGTERM on to both
    workers, which save the same step and exit 75 before torchrun's shutdown timeout."""
    args = ("--training.steps", "500", "--checkpoint.interval", "400",
            "--parallelism.data_parallel_shard_degree", "2", "--validator.no-enable")  # fmt: skip
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(_train(driver, tmp_path / "run", *args, nproc=2), env=env,
                                cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "step:  3 " not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
    log = log_path.read_text()
    marker = json.loads((tmp_path / "run" / "preempted.json").read_text())
    step, ckpt = marker["step"], tmp_path / "run" / "checkpoint"
    assert 3 <= step < 500 and marker["signal"] == "SIGTERM"
    assert f"preempted at step {step}: saved {ckpt}/step-{step}; rerun" in log, log[-4000:]
    assert integrity.problem(ckpt / f"step-{step}") is None


def test_a_full_disk_ends_in_one_line_and_the_next_run_resumes(env, driver, reference, tmp_path):
    cmd = _train(driver, tmp_path, *STEPS, *DETERMINISTIC)
    p = _run(cmd, env, FULL_AT=10, FREE_BYTES=1000)
    log = _ok(p, rc=1)
    ckpt = tmp_path / "checkpoint"
    assert "only 0.0 MiB free where checkpoints go" in p.stdout  # before the first save
    err = [s for s in p.stderr.splitlines() if s.strip()]
    assert err[-1].startswith(
        f"error: could not write checkpoint {ckpt}/step-10: No space left on device (ENOSPC) "
        f"({ckpt}/step-10/"
    ), err[-1]
    assert err[-1].endswith(
        f"; the last complete checkpoint is {ckpt}/step-5; free space, then rerun the same "
        "command to resume"
    )
    for noise in ("Traceback", "Logging error", "Errno 28", "CheckpointException"):
        assert noise not in log, noise
    assert log.count("No space left on device") == 1  # the error line's
    assert integrity.interrupted(ckpt / "step-10") is not None  # still marked unfinished
    assert integrity.problem(ckpt / "step-5") is None

    log = _ok(_run(cmd, env))  # space freed: the same command
    assert f"Loading the checkpoint from {ckpt}/step-5" in log
    assert (ckpt / "rejected" / "step-10").is_dir()
    resumed, ref = _history(tmp_path), _history(reference)
    assert sorted(resumed) == list(range(6, 13))
    assert {s: ref[s] for s in resumed} == resumed


def test_a_save_past_the_grace_period_is_left_unfinished(env, driver, tmp_path):
    args = ("--training.steps", "6", "--checkpoint.interval", "2",
            "--preemption.grace_seconds", "2", *DETERMINISTIC)  # fmt: skip
    log = _ok(_run(_train(driver, tmp_path, *args), env, SIGNAL_AT=3, SLOW_AT=3), rc=75)
    ckpt = tmp_path / "checkpoint"
    assert (
        f"preempted at step 3: the save of {ckpt}/step-3 did not finish within 2 s of the "
        f"signal; exiting without it; the last complete checkpoint is {ckpt}/step-2; rerun the "
        "same command to resume"
    ) in log, log[-3000:]
    assert integrity.interrupted(ckpt / "step-3") is not None
    assert integrity.problem(ckpt / "step-2") is None
