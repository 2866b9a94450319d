"""The Trainer on CPU end to end (subprocesses): 1 process, 2 processes with FSDP2 on gloo,
compile, SIGKILL + resume (bitwise), a checkpoint from another model, NaN loss.

All runs use ``cpu_smoke`` (the ``debug`` flavor) on a tiny corpus built in a temp dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import forkserver
from titan_lrattnres.components import integrity
from titan_lrattnres.training import cpu

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
DETERMINISTIC = ["--debug.seed", "0", "--debug.deterministic"]


def _train_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "titan_lrattnres.train", "cpu_smoke", *args]


def _run(cmd, env, timeout=300, fresh=False) -> subprocess.CompletedProcess:
    """``cmd``'s result; forked from the test's pre-imported server unless ``fresh`` (a new
    interpreter, as a user starts it)."""
    if fresh:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    return forkserver.run(cmd, env=env, cwd=ROOT, timeout=timeout)


def _ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])


def _history(folder: Path) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((folder / "loss_history.json").read_text())}


def _ckpts(folder: Path) -> list[int]:
    d = folder / "checkpoint"
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if integrity.interrupted(p) is None)


@pytest.fixture(scope="module")
def reference_run(env, tmp_path_factory):
    """An uninterrupted deterministic 1-process run: 40 steps, checkpoint every 5."""
    out = tmp_path_factory.mktemp("ref")
    t = time.perf_counter()
    p = _run(
        _train_cmd(
            "--dump_folder",
            str(out),
            "--training.steps",
            "40",
            "--checkpoint.interval",
            "5",
            *DETERMINISTIC,
        ),
        env,
        fresh=True,
    )
    _ok(p)
    print(f"reference run: {time.perf_counter() - t:.1f}s")
    return out


def test_shim_is_idempotent_and_pins_torchtitan(monkeypatch):
    assert cpu.apply() and cpu.apply() and cpu.is_applied() and cpu._released_at_exit
    import torch
    from torchtitan.tools import utils

    assert utils.device_type == "cpu" and utils.device_module is torch.cpu
    assert torch.cpu.get_device_properties().total_memory > 0
    monkeypatch.setattr(cpu.importlib.metadata, "version", lambda _: "0.4.0")
    with pytest.warns(RuntimeWarning, match="0.3.0 internals; installed is 0.4.0"):
        cpu.check_torchtitan_version()


GLOO_THREADS = textwrap.dedent("""
    import sys, tempfile, time, torch.distributed as dist
    from titan_lrattnres.training import cpu
    before = cpu._gloo_threads()
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    # a new thread names itself once it runs: until then /proc shows the creator's name
    deadline = time.monotonic() + 10
    while not cpu._gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    print(before, cpu._gloo_threads())
    dist.destroy_process_group()
""")


def test_gloo_threads_are_seen_for_the_exit_release(env):
    """``release_gloo_at_exit`` waits at exit only while gloo's worker threads exist: it must see
    them (by name)."""
    p = subprocess.run([sys.executable, "-c", GLOO_THREADS], env=env, cwd=ROOT, text=True,
                       capture_output=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = map(int, p.stdout.split())
    assert before == 0 and after > 0, p.stdout


HELPER_TEAM = textwrap.dedent("""
    import json, os, sys, tempfile, torch, torch.distributed as dist
    from titan_lrattnres.training import cpu
    torch.set_num_threads(2)  # a team of two on any machine
    applied = sys.argv[1] == "1" and cpu.serial_helper_threads()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1)
    (torch.ones(1 << 20) * 2).sum()  # this thread's team exists
    before = len(os.listdir("/proc/self/task"))
    out = [None]
    dist.all_gather_object(out, list(range(200_000)))  # copied on a gloo worker thread
    new = len(os.listdir("/proc/self/task")) - before
    print(json.dumps({"applied": applied, "new_threads": new, "threads": torch.get_num_threads()}))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_collectives_start_no_second_openmp_team(env):
    """``serial_helper_threads``: a gloo worker's copy starts its own OpenMP team without it (one
    more thread, and every team then sleeps between regions); with it that thread computes alone
    and this one keeps its two threads."""
    runs = {}
    for patched in ("0", "1"):
        p = subprocess.run([sys.executable, "-c", HELPER_TEAM, patched], env=env, cwd=ROOT,
                           text=True, capture_output=True, timeout=120)  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        runs[patched] = json.loads(p.stdout.strip().splitlines()[-1])
    assert runs["0"]["new_threads"] >= 1, runs  # the premise: without it a team is started
    assert runs["1"] == {"applied": True, "new_threads": 0, "threads": 2}, runs


def test_single_process_run_learns_and_writes_summary(reference_run):
    s = json.loads((reference_run / "summary.json").read_text())
    hist = _history(reference_run)
    assert s["config"] == "cpu_smoke" and s["steps"] == 40 and sorted(hist) == list(range(1, 41))
    assert s["tokens"] == 40 * 4 * 128
    assert hist[40] < hist[1] - 0.5, hist
    assert s["final_val_loss"] is not None and s["final_val_loss"] < hist[1]
    assert s["tokens_per_s"] > 0 and s["peak_rss_mib"] > 0 and "unigram_entropy" in s
    # the steps' throughput leaves the final save and validation out; the wall figure keeps them
    assert s["tokens_per_s"] > s["tokens_per_s_wall"] > 0, s
    assert (reference_run / "loss.png").stat().st_size > 1000
    assert _ckpts(reference_run)[-1] == 40
    fp = json.loads((reference_run / "checkpoint" / "model_fingerprint.json").read_text())
    assert fp["variant"] == "sliced" and fp["rank"] == 16


def test_sigkill_then_resume_is_bitwise_identical(env, reference_run, tmp_path):
    args = (
        "--dump_folder",
        str(tmp_path),
        "--training.steps",
        "40",
        "--checkpoint.interval",
        "5",
        *DETERMINISTIC,
    )
    proc = subprocess.Popen(
        _train_cmd(*args), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    try:
        while not _ckpts(tmp_path):
            assert proc.poll() is None, "run ended before its first checkpoint"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _ckpts(tmp_path)[-1]
    assert killed_at < 40
    p = _run(_train_cmd(*args), env)
    _ok(p)
    assert (
        f"Loading the checkpoint from {tmp_path}/checkpoint/step-{killed_at}" in p.stderr + p.stdout
    )
    resumed, ref = _history(tmp_path), _history(reference_run)
    assert min(resumed) == killed_at + 1 and max(resumed) == 40
    assert {s: ref[s] for s in resumed} == resumed  # bitwise: same floats, same data order


def test_checkpoint_from_another_variant_is_refused(env, reference_run):
    before = sorted(p.name for p in (reference_run / "checkpoint").iterdir())
    p = _run(
        [
            sys.executable,
            "-m",
            "titan_lrattnres.train",
            "cpu_default_projected",
            "--dump_folder",
            str(reference_run),
            "--training.steps",
            "41",
            "--training.seq_len",
            "128",
            "--compile.no-enable",
        ],
        env,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "variant: checkpoint='sliced' vs this run='projected'" in p.stderr
    assert "dim: checkpoint=64 vs this run=128" in p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(p.name for p in (reference_run / "checkpoint").iterdir()) == before


def test_compile_aot_eager_matches_eager(env, reference_run, tmp_path):
    p = _run(
        _train_cmd(
            "--dump_folder",
            str(tmp_path),
            "--training.steps",
            "40",
            "--checkpoint.no-enable",
            "--compile.enable",
            "--compile.backend",
            "aot_eager",
            *DETERMINISTIC,
        ),
        env,
    )
    _ok(p)
    got, ref = _history(tmp_path), _history(reference_run)
    for step in (1, 10, 40):
        assert got[step] == pytest.approx(ref[step], rel=2e-3, abs=2e-3)


def test_compile_inductor_trains(env, tmp_path):
    p = _run(
        _train_cmd(
            "--dump_folder",
            str(tmp_path),
            "--training.steps",
            "4",
            "--checkpoint.no-enable",
            "--validator.no-enable",
            "--compile.enable",
        ),
        env,
        timeout=600,
    )
    _ok(p)
    hist = _history(tmp_path)
    assert sorted(hist) == [1, 2, 3, 4] and all(v == v for v in hist.values())


def test_two_processes_fsdp2_gloo_via_torchtitan_module(env, tmp_path):
    """The ``--module`` path (the shim comes in through config_registry, after torchtitan):
    FSDP2 over 2 gloo ranks with per-sublayer compile."""
    p = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "-m",
            "torchtitan.train",
            "--module",
            "titan_lrattnres",
            "--config",
            "cpu_smoke",
            "--dump_folder",
            str(tmp_path),
            "--training.steps",
            "10",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--checkpoint.interval",
            "5",
            "--compile.enable",
            "--compile.backend",
            "aot_eager",
        ],
        env,
        timeout=600,
    )
    _ok(p)
    log = p.stdout + p.stderr
    assert "Applied FSDP to the model" in log
    assert "Compiling each TransformerBlock" in log
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and s["tokens"] == 10 * 4 * 128 * 2
    hist = _history(tmp_path)
    assert hist[10] < hist[1] and s["final_val_loss"] is not None
    assert _ckpts(tmp_path) == [5, 10]


NAN_DRIVER = textwrap.dedent("""
    import sys
    from titan_lrattnres.training import cpu
    cpu.apply()
    import torchtitan.trainer as tt
    original = tt.Trainer._forward_backward_body
    def body(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        return loss * float("nan") if self.step >= 7 else loss
    tt.Trainer._forward_backward_body = body
    from titan_lrattnres.train import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("log_freq, stop_step", [(1, 7), (1000, 10)])
def test_nan_loss_stops_and_keeps_last_good_checkpoint(env, tmp_path, log_freq, stop_step):
    driver = tmp_path / "nan_driver.py"
    driver.write_text(NAN_DRIVER)
    out = tmp_path / "run"
    p = _run(
        [
            sys.executable,
            str(driver),
            "cpu_smoke",
            "--dump_folder",
            str(out),
            "--training.steps",
            "20",
            "--checkpoint.interval",
            "5",
            "--metrics.log_freq",
            str(log_freq),
            "--validator.no-enable",
        ],
        env,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"not finite (NaN/inf) at step {stop_step}" in p.stderr
    assert f"last good checkpoint is kept: {out}/checkpoint/step-5" in p.stderr
    assert _ckpts(out) == [5]
