"""Checkpoint integrity (``titan_lrattnres.components.integrity``): every kind of checkpoint the
project saves carries a complete checksum record and passes the vetting; a damaged, truncated,
interrupted or malicious checkpoint, and a malicious ``--tokens-file``, is refused by name at
every entry point (analysis, export, generation, sweep, training resume) and runs no code; a
run killed in the middle of a save resumes from the previous complete checkpoint.

In process: a DCP folder saved by ``dcp.save`` + the record. Subprocesses (slow): ``cpu_smoke``
on a tiny corpus: a seed checkpoint and a reference run (module fixtures), a chain of two runs
killed mid-save and their resume, a refused resume, and a 2-rank FSDP2 save."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests import forkserver
from titan_lrattnres.components import integrity
from titan_lrattnres.evaluation import analysis, export, generate, sweep
from titan_lrattnres.evaluation.inference import build_model, load_model
from titan_lrattnres.train import finished_step
from titan_lrattnres.training import cpu

ROOT = Path(__file__).resolve().parents[3]
ARGS = dict(flavor="debug", variant="sliced", blocks=2, rank=16, vocab_size=256)
SHARD = "__0_0.distcp"


class CreatesFile:
    """Pickles to a call that creates ``path``: ``os.system("touch ...")`` or ``open(path, "w")``
    (``builtins.open`` pickles as ``io.open``)."""

    def __init__(self, path: Path, how: str = "system"):
        self.path, self.how = path, how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"touch {self.path}",)
        return open, (str(self.path), "w")


def plant_metadata(step: Path, marker: Path, how: str = "system", rerecord: bool = True) -> None:
    """Replace ``step/.metadata`` by a pickle that would create ``marker``; ``rerecord``: and
    the record with one that matches it (so that only the vetting can refuse it)."""
    (step / ".metadata").write_bytes(pickle.dumps({"state": CreatesFile(marker, how)}))
    if rerecord:
        integrity.record(step)


def random_bytes(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(np.random.default_rng(0).bytes(4096))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run folder: ``model_args.json`` + ``checkpoint/step-3`` (model weights and a non-tensor
    item) with its record."""
    torch.manual_seed(0)
    model = build_model(ARGS, depth_backend="reference")
    run = tmp_path_factory.mktemp("saved")
    step = run / "checkpoint" / "step-3"
    integrity.begin(step)
    dcp.save({**model.state_dict(), "train_state": {"step": 3}}, checkpoint_id=str(step))
    integrity.record(step)
    (run / "model_args.json").write_text(json.dumps(ARGS))
    return run


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A copy of ``saved`` to damage."""
    return Path(shutil.copytree(saved, tmp_path / "run"))


def test_record_covers_every_file_and_passes(saved):
    step = saved / "checkpoint" / "step-3"
    rec = integrity.read_record(step)
    assert rec["complete"] and rec["algorithm"] == "sha256"
    assert sorted(rec["files"]) == [".metadata", SHARD]
    for name, entry in rec["files"].items():
        assert entry["size"] == (step / name).stat().st_size
    assert integrity.problem(step) is None and integrity.vet(step) is None


CLIS = {
    "analysis": lambda run, out: analysis.main(["--run", str(run), "--out", str(out), "--random"]),
    "export": lambda run, out: export.main(["--run", str(run), "--out", str(out)]),
    "generate": lambda run, out: generate.main(["--run", str(run), "--prompt", "1,2"]),
}
DAMAGE = {  # what is done to step-3 -> what the one-line refusal says
    "random_bytes": (lambda s, m: random_bytes(s / SHARD), f"{SHARD} is corrupted (SHA-256"),
    "truncated": (lambda s, m: truncate(s / SHARD), f"{SHARD} has "),
    "missing": (lambda s, m: (s / SHARD).unlink(), f"{SHARD} is missing"),
    "interrupted": (lambda s, m: integrity.begin(s), "marks the save unfinished"),
    "bad_record": (lambda s, m: (s / integrity.RECORD).write_text("{"), "json is unreadable"),
    "os_system": (lambda s, m: plant_metadata(s, m), ".metadata refers to posix.system"),
    "builtins_open": (lambda s, m: plant_metadata(s, m, "open"), ".metadata refers to io.open"),
    "unrecorded_os_system": (
        lambda s, m: (plant_metadata(s, m, rerecord=False), (s / integrity.RECORD).unlink()),
        ".metadata refers to posix.system",
    ),
}


@pytest.mark.parametrize("cli", sorted(CLIS))
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_clis_refuse_a_damaged_checkpoint_in_one_line(run, tmp_path, cli, damage):
    step, marker = run / "checkpoint" / "step-3", tmp_path / "created_by_pickle"
    do, says = DAMAGE[damage]
    do(step, marker)
    with pytest.raises(SystemExit) as e:
        CLIS[cli](run, tmp_path / "out")
    line = str(e.value.code)
    assert line.startswith(f"error: checkpoint {step}") and says in line, line
    assert "\n" not in line and not marker.exists()


def test_unrecorded_folder_loads_with_a_warning(run, caplog):
    step = run / "checkpoint" / "step-3"
    (step / integrity.RECORD).unlink()
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        load_model(run)
    assert f"checkpoint {step} has no checksums.json" in caplog.text
    truncate(step / SHARD)  # nothing to compare with: DCP's own error, in one line
    with pytest.raises(integrity.CheckpointIntegrityError, match=f"checkpoint {step} cannot be"):
        load_model(run)


def test_unsafe_non_tensor_item_is_refused(tmp_path):
    marker = tmp_path / "created_by_pickle"
    dcp.save({"w": torch.ones(3), "evil": CreatesFile(marker)}, checkpoint_id=str(tmp_path))
    why = integrity.vet(tmp_path)
    assert why.startswith(f"item evil of {SHARD} is not plain data (it refers to posix.system")
    assert not marker.exists()


def test_sweep_evaluation_refuses_a_damaged_checkpoint(run, monkeypatch):
    import titan_lrattnres.evaluation.inference as inference

    monkeypatch.setattr(inference, "default_validation_source", lambda: ("val", "tok"))
    random_bytes(run / "checkpoint" / "step-3" / SHARD)
    with pytest.raises(integrity.CheckpointIntegrityError, match=f"{SHARD} is corrupted"):
        sweep.evaluate_run(run, {"local_batch_size": 1, "seq_len": 8, **ARGS}, 1)


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_tokens_file_is_loaded_without_running_code(tmp_path, suffix):
    ids = torch.arange(10)
    good, evil, marker = tmp_path / f"ok{suffix}", tmp_path / f"evil{suffix}", tmp_path / "pwn"
    if suffix == ".pt":
        torch.save(ids, good)
        torch.save({"ids": ids, "x": CreatesFile(marker)}, evil)
    else:
        np.save(good, ids.numpy())
        np.save(evil, np.array([CreatesFile(marker)], dtype=object), allow_pickle=True)
    assert torch.equal(analysis.load_token_file(good), ids)
    ns = SimpleNamespace(tokens_file=str(evil))
    with pytest.raises(SystemExit) as e:
        analysis.pick_tokens(ns, 256)
    line = str(e.value.code)
    assert line.startswith(f"error: --tokens-file {evil} refused: ") and "\n" not in line, line
    assert not marker.exists()


def _steps(run: Path, *steps: int) -> Path:
    """``run/checkpoint`` with copies of step-3 as ``step-N`` for each N."""
    src = (run / "checkpoint" / "step-3").rename(run / "step-3")
    for n in steps:
        shutil.copytree(src, run / "checkpoint" / f"step-{n}")
    return run / "checkpoint"


def test_resume_skips_damaged_and_interrupted_newer_checkpoints(run, tmp_path, caplog):
    folder = _steps(run, 1, 2, 3, 4)
    random_bytes(folder / "step-4" / SHARD)
    plant_metadata(folder / "step-3", tmp_path / "pwn")
    (folder / "step-2" / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        assert integrity.resume_folder(folder) == folder / "step-1"
    for n, why in ((4, "is corrupted"), (3, "refers to posix.system"), (2, "no .metadata")):
        assert f"resume: skipping checkpoint {folder}/step-{n}" in caplog.text
        assert why in caplog.text and f"moved it to {folder}/rejected/step-{n}" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == ["rejected", "step-1"]
    assert not (tmp_path / "pwn").exists()


def test_resume_with_nothing_intact(run):
    folder = _steps(run, 1, 2)
    (folder / "step-2" / ".metadata").unlink()  # interrupted: a fresh start loses nothing
    truncate(folder / "step-1" / SHARD)
    with pytest.raises(integrity.CheckpointIntegrityError, match="no intact checkpoint") as e:
        integrity.resume_folder(folder)
    assert f"step-1: {SHARD} has " in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2"]  # nothing moved
    shutil.rmtree(folder / "step-1")
    assert integrity.resume_folder(folder) is None
    assert [p.name for p in (folder / "rejected").iterdir()] == ["step-2"]


def test_finished_step_needs_an_intact_final_checkpoint(run):
    folder = _steps(run, 2, 4)
    config = SimpleNamespace(
        dump_folder=str(run),
        checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
        training=SimpleNamespace(steps=4),
    )
    assert finished_step(config) == 4
    random_bytes(folder / "step-4" / SHARD)
    assert finished_step(config) == -1


# -- damage past the first hashing chunk (files hash CHUNK bytes a read; shards are gigabytes) ---
SMALL_CHUNK = 1024  # monkeypatched in: a few-KB file then spans several chunks
SHARD_BYTES = 3 * SMALL_CHUNK + 100  # three whole chunks and a partial one
HF_SHARD = "model-00001-of-00001.safetensors"


def hf_step(folder: Path, size: int) -> Path:
    """A recorded HF-format step folder (the index and one shard of ``size`` random bytes; no
    ``.metadata``, so only sizes and checksums are checked)."""
    folder.mkdir()
    (folder / integrity.HF_INDEX).write_text("{}")
    (folder / HF_SHARD).write_bytes(np.random.default_rng(1).bytes(size))
    integrity.record(folder)
    assert integrity.problem(folder) is None
    return folder


def flip(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` (the size stays)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def corrupted(step: Path, name: str) -> str:
    return f"checkpoint {step}: {name} is corrupted (SHA-256 differs from {integrity.RECORD})"


@pytest.mark.parametrize(
    "offset",
    [SMALL_CHUNK, 2 * SMALL_CHUNK + 511, 3 * SMALL_CHUNK, SHARD_BYTES - 1],
    ids=["second_chunk_first_byte", "third_chunk", "last_partial_chunk", "last_byte"],
)
def test_a_flipped_byte_past_the_first_chunk_is_refused(tmp_path, monkeypatch, offset):
    monkeypatch.setattr(integrity, "CHUNK", SMALL_CHUNK)
    step = hf_step(tmp_path / "step-1", SHARD_BYTES)
    flip(step / HF_SHARD, offset)
    assert integrity.problem(step) == corrupted(step, HF_SHARD)
    with pytest.raises(integrity.CheckpointIntegrityError, match=f"{HF_SHARD} is corrupted"):
        integrity.check(step)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_file_cut_or_grown_past_the_first_chunk_is_refused(tmp_path, monkeypatch, change):
    """Refused for its size; and with the recorded size forged to match, for its SHA-256 (the
    first chunk is intact either way)."""
    monkeypatch.setattr(integrity, "CHUNK", SMALL_CHUNK)
    step = hf_step(tmp_path / "step-1", SHARD_BYTES)
    shard = step / HF_SHARD
    if change == "truncated":
        size = 2 * SMALL_CHUNK + 10
        os.truncate(shard, size)
    else:
        size = SHARD_BYTES + SMALL_CHUNK
        with open(shard, "ab") as f:
            f.write(bytes(SMALL_CHUNK))
    cut = " (truncated)" if change == "truncated" else ""
    says = f"checkpoint {step}: {HF_SHARD} has {size} bytes, {SHARD_BYTES} recorded{cut}"
    assert integrity.problem(step) == says
    rec = integrity.read_record(step)
    rec["files"][HF_SHARD]["size"] = size
    integrity.write_json(step / integrity.RECORD, rec)
    assert integrity.problem(step) == corrupted(step, HF_SHARD)


def test_a_flipped_byte_past_the_real_first_chunk_is_refused(tmp_path):
    """The shipped chunk size: a file of one chunk and a half, damaged in its second."""
    step = hf_step(tmp_path / "step-1", integrity.CHUNK + integrity.CHUNK // 2)
    flip(step / HF_SHARD, integrity.CHUNK + 4096)
    assert integrity.problem(step) == corrupted(step, HF_SHARD)


def test_a_dcp_shard_damaged_past_the_first_chunk_is_refused_by_load(run, monkeypatch):
    """A real checkpoint with 4 KB chunks: its shard's last tensor byte flipped."""
    monkeypatch.setattr(integrity, "CHUNK", 4096)
    step, shard = run / "checkpoint" / "step-3", run / "checkpoint" / "step-3" / SHARD
    assert shard.stat().st_size > 4 * integrity.CHUNK
    flip(shard, shard.stat().st_size - 1)
    with pytest.raises(integrity.CheckpointIntegrityError, match=f"{SHARD} is corrupted"):
        load_model(run)
    assert integrity.problem(step) == corrupted(step, SHARD)


# -- the trainer (subprocesses) -------------------------------------------------------------------
STEPS = ["--training.steps", "6", "--checkpoint.interval", "2", "--validator.no-enable"]
DETERMINISTIC = ["--debug.seed", "0", "--debug.deterministic"]

KILL_DRIVER = textwrap.dedent("""
    # kill_driver.py WHERE STEP ARGS...: SIGKILL itself in the save of step-STEP, after the
    # data files and .metadata but before the checksum record (WHERE=record), or after the
    # data files but before .metadata (WHERE=metadata)
    import os, signal, sys
    from titan_lrattnres.training import cpu
    cpu.apply()
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from titan_lrattnres.components import integrity
    from titan_lrattnres.train import main
    where, step = sys.argv[1], sys.argv[2]

    def killing(f, folder_of):
        def wrapped(first, *args, **kwargs):
            if str(folder_of(first)).endswith(f"step-{step}"):
                os.kill(os.getpid(), signal.SIGKILL)
            return f(first, *args, **kwargs)
        return wrapped

    if where == "record":
        integrity.record = killing(integrity.record, lambda folder: folder)
    else:
        FileSystemWriter.finish = killing(FileSystemWriter.finish, lambda writer: writer.path)
    sys.exit(main(sys.argv[3:]))
""")


def _train(env, *args, driver: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(driver or ["-m", "titan_lrattnres.train"]), "cpu_smoke", *args]
    return forkserver.run(cmd, env=env, cwd=ROOT, timeout=600)


def _ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def seed(env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed")
    _ok(_train(env, "--dump_folder", str(out), "--checkpoint.create_seed_checkpoint"))
    return out / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def reference(env, seed, tmp_path_factory) -> Path:
    """6 steps from the seed, checkpoints at 2 and 4 saved asynchronously, the last step
    model-only."""
    out = tmp_path_factory.mktemp("reference")
    args = ["--checkpoint.initial_load_path", str(seed), "--checkpoint.last_save_model_only"]
    log = _ok(
        _train(env, "--dump_folder", str(out), *STEPS, *DETERMINISTIC, *args,
               "--checkpoint.async_mode", "async")
    )  # fmt: skip
    assert f"checkpoint {seed}: 2 files match checksums.json" in log
    return out


def _history(run: Path) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((run / "loss_history.json").read_text())}


@pytest.mark.slow
def test_every_checkpoint_the_trainer_saves_is_recorded_and_vetted(seed, reference):
    folders = [seed] + [reference / "checkpoint" / f"step-{n}" for n in (2, 4, 6)]
    for step in folders:
        rec = integrity.read_record(step)
        assert rec["complete"] and sorted(rec["files"]) == integrity._files(step), step
        assert integrity.problem(step) is None, step
    model_only = integrity.read_record(folders[-1])["files"][".metadata"]["size"]
    assert model_only < integrity.read_record(folders[-2])["files"][".metadata"]["size"]


@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_the_previous_complete_checkpoint(
    env, seed, reference, tmp_path
):
    driver = tmp_path / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    out, marker = tmp_path / "run", tmp_path / "created_by_pickle"
    args = ["--dump_folder", str(out), *STEPS, *DETERMINISTIC, "--checkpoint.last_save_model_only",
            "--checkpoint.initial_load_path", str(seed)]  # fmt: skip
    ckpt = out / "checkpoint"

    p = _train(env, *args, driver=[str(driver), "record", "4"])
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert integrity.problem(ckpt / "step-2") is None
    assert "marks the save unfinished" in integrity.problem(ckpt / "step-4")

    p = _train(env, *args, driver=[str(driver), "metadata", "4"])
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    log = p.stdout + p.stderr
    assert f"resume: skipping checkpoint {ckpt}/step-4: checksums.json marks the save" in log
    assert f"moved it to {ckpt}/rejected/step-4" in log
    assert f"Loading the checkpoint from {ckpt}/step-2" in log
    assert not (ckpt / "step-4" / ".metadata").exists()

    # and a planted step-8 whose .metadata would create a file: no finished run, no code run
    shutil.copytree(ckpt / "step-2", ckpt / "step-8")
    plant_metadata(ckpt / "step-8", marker)
    log = _ok(_train(env, *args))
    assert f"resume: skipping checkpoint {ckpt}/step-8: .metadata refers to posix.system" in log
    assert f"skipping checkpoint {ckpt}/step-4 has no .metadata: its save was interrupted" in log
    assert f"moved it to {ckpt}/rejected/step-4.1" in log
    assert f"Loading the checkpoint from {ckpt}/step-2" in log
    resumed, ref = _history(out), _history(reference)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert resumed == {s: ref[s] for s in resumed}  # bitwise: the same run as the reference
    assert sorted(p.name for p in (ckpt / "rejected").iterdir()) == ["step-4", "step-4.1", "step-8"]
    assert not marker.exists() and integrity.problem(ckpt / "step-6") is None


@pytest.mark.slow
def test_resume_refuses_a_malicious_metadata_in_one_line(env, reference, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "created_by_pickle"
    step = out / "checkpoint" / "step-2"
    shutil.copytree(reference / "checkpoint" / "step-2", step)
    plant_metadata(step, marker, "open")
    p = _train(env, "--dump_folder", str(out), *STEPS)
    assert p.returncode == 1, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: no intact checkpoint to resume from: checkpoint {step}: .metadata refers to "
        f"io.open, which no DCP metadata does: refused (it could run code). Move the damaged "
        f"step folders out of {out}/checkpoint to start afresh"
    ], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not marker.exists() and step.is_dir()


TWO_RANKS = textwrap.dedent("""
    import importlib.util, os, sys, torch
    import torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # by path: the package's __init__ would import torchtitan (seconds a rank)
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    integrity = load("integrity", sys.argv[2])
    load("cpu", sys.argv[3]).release_gloo_at_exit()  # no SIGABRT at exit (see release_gloo_at_exit)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    folder = sys.argv[1]
    integrity.begin(folder)
    dcp.save({**model.state_dict(), "train_state": {"step": 3}}, checkpoint_id=folder)
    integrity.record(folder)

    def say(what):  # one write per line: the ranks share stdout
        found = integrity.problem(folder, distributed=True)
        os.write(1, f"{what} {dist.get_rank()} {found}\\n".encode())

    say("intact")
    dist.barrier()
    if dist.get_rank() == 0:  # rank 1 hashes this file: the ranks must share what they find
        with open(f"{folder}/__0_0.distcp", "r+b") as f:
            f.seek(-1, 2)  # a bit of the last tensor (non-tensor items come first)
            last = f.read(1)[0]
            f.seek(-1, 2)
            f.write(bytes([last ^ 1]))
    dist.barrier()
    say("damaged")
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_rank_fsdp_save_is_recorded_and_vetted(env, tmp_path):
    script, folder = tmp_path / "two_ranks.py", tmp_path / "step-1"
    script.write_text(TWO_RANKS)
    p = forkserver.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend",
         "c10d", "--rdzv_endpoint", "localhost:0", str(script), str(folder), integrity.__file__,
         cpu.__file__],
        env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(integrity.read_record(folder)["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    damaged = (
        f"checkpoint {folder}: __0_0.distcp is corrupted (SHA-256 differs from checksums.json)"
    )
    assert sorted(p.stdout.splitlines()) == [f"damaged {r} {damaged}" for r in (0, 1)] + [
        f"intact {r} None" for r in (0, 1)
    ]
