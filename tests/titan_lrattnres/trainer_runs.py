"""Several ``python -m titan_lrattnres.train`` runs in one process, for the golden and parity
tests: one import of torch and torchtitan (~10 s on 2 cores) instead of one per run. Each run
goes through the project's entry point (``titan_lrattnres.train.main``) unchanged: the real
Trainer, data, loss, optimizer, LR schedule and checkpointer.

    python -m tests.titan_lrattnres.trainer_runs RUNS.json OUT.json

``RUNS.json``: ``[{"name": str, "argv": [CONFIG, "--dump_folder", DIR, ...]}, ...]``, run in
order. ``OUT.json`` (written by rank 0): ``{"environment": environment(), "runs": {name: run}}``
with run = ``{"rc": int, "wall_s": float, "output": the run's stdout and stderr (its log and
error line), "history": loss_history.json or None, "val_history": [{"step", "loss"}] or None,
"grad_norm_fp64": [per step]}`` (see ``_record_fp64_grad_norms``).
Under torchrun every rank runs the same list; each run gets a fresh rendezvous port from rank 0
(``run()`` destroys the process group at the end of a run, and a second group on the same store
would find the first one's keys) and a fresh thread (see ``_in_fresh_thread``).

Also here: the tiny corpus the tests train on, and the launchers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests import forkserver

ROOT = Path(__file__).resolve().parents[2]
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def tiny_corpus_env(cache: Path) -> dict[str, str]:
    """A subprocess environment whose data cache holds a tiny stdlib corpus (the first 60 train
    and 8 validation files of this Python's stdlib, V=1024), built under ``cache``."""
    from titan_lrattnres.components import data

    if data.load_manifest(cache) is None:
        files = data.stdlib_files()
        train = [f for f in files if not data.is_validation(f[0])][:60]
        val = [f for f in files if data.is_validation(f[0])][:8]
        data.build_corpus(data.corpus_dir(cache), train + val, vocab_size=1024)
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",  # the thread count decides reduction orders: fixed
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
    )
    env[data.CACHE_ENV] = str(cache)
    return env


def launch(runs: list[dict], workdir: Path, env: dict, nproc: int = 1, timeout: int = 600):
    """Run ``runs`` in one process (or ``nproc`` torchrun ranks); returns ``OUT.json``'s
    ``(runs, environment)``."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "runs.json", workdir / "results.json"
    spec.write_text(json.dumps(runs, indent=1))
    out.unlink(missing_ok=True)
    me = ["-m", "tests.titan_lrattnres.trainer_runs", str(spec), str(out)]
    if nproc > 1:
        me = [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            *me,
        ]
    p = forkserver.run([sys.executable, *me], env=env, cwd=ROOT, timeout=timeout)
    assert p.returncode == 0 and out.exists(), (p.stdout[-3000:], p.stderr[-6000:])
    result = json.loads(out.read_text())
    return result["runs"], result["environment"]


def environment() -> dict:
    """What decides the bits of a CPU run here: software (Python and its stdlib, which the tiny
    corpus is cut from; torch; torchtitan; the corpus and tokenizer by content hash) and
    hardware (ATen's SIMD dispatch, MKL/oneDNN kernels and the -march=native C kernels follow
    the CPU; the thread count sets reduction orders; the C compiler)."""
    import hashlib
    import importlib.metadata as md
    import platform
    import shutil

    import torch

    from custom_ops import cpu as cpu_kernels
    from titan_lrattnres.components import data

    info = cpu_kernels.cpu_info()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True) if cc else None
    manifest = data.load_manifest() or {}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": md.version("torchtitan"),
        "corpus": manifest.get("content_hash"),
        "machine": platform.machine(),
        "cpu": info.get("model name", platform.processor()),
        "cpu_flags_sha256": hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:16],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "c_compiler": f"{cc}: {version.stdout.splitlines()[0]}" if version else None,
        "c_kernels": cpu_kernels.library() is not None,
        "tokenizers": md.version("tokenizers"),
        "datasets": md.version("datasets"),
    }


def _port_exchange():
    """``(rank, world, next_port)``; ``next_port(i)`` agrees on a fresh port for run ``i``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, lambda i: None
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent,
    )

    def next_port(i: int) -> int:
        key = f"lrattnres_trainer_runs/{i}/port"
        if rank == 0:
            store.set(key, str(forkserver.free_port()))
        return int(store.get(key))

    next_port.store = store  # kept alive for the whole list
    return rank, world, next_port


class _Capture(io.StringIO):
    """Output of one run; libraries that need a real file get stderr's descriptor."""

    def fileno(self) -> int:
        return sys.__stderr__.fileno()


def _in_fresh_thread(fn, *args):
    """``fn(*args)`` in a new thread: torchtitan and spmd_types keep device-mesh state in
    thread-locals, and a second 2-rank run in the same thread trips on the first one's
    (fully_shard: "Expected param's DTensor mesh to be the same mesh passed to fully_shard")."""
    out: list = []

    def target():
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: B036 (re-raised in the caller's thread)
            out.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


_FP64_NORMS: list[float] = []


def _record_fp64_grad_norms() -> None:
    """Beside each step's clipping, note the gradient norm summed in float64 over the full
    gradients (``grad_norm_fp64``); the clipping itself is untouched. The logged norm is
    torch's float32 one, whose rounding depends on how the gradients are sharded: on CPU it
    drops the squares of the many tiny entries of the head's gradient (rows of tokens the tiny
    corpus never uses) differently for one [4096, 64] tensor than for two [2048, 64] shards
    (1.1e-4 relative on that tensor, 1e-5 to 3e-5 on the total)."""
    import torch
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.tensor import DTensor

    clip = dist_utils.clip_grad_norm_

    def clip_and_record(parameters, *args, **kwargs):
        parameters = list(parameters)
        total = torch.zeros((), dtype=torch.float64)
        for p in parameters:
            if p.grad is not None:  # full_tensor: a collective every rank makes in this order
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                total += g.double().pow(2).sum()
        _FP64_NORMS.append(float(total.sqrt()))
        return clip(parameters, *args, **kwargs)

    dist_utils.clip_grad_norm_ = clip_and_record


def main(spec_path: str, out_path: str) -> int:
    from titan_lrattnres import train
    from titan_lrattnres.training import cpu

    cpu.apply()  # before torchtitan is imported
    _record_fp64_grad_norms()
    runs = json.loads(Path(spec_path).read_text())
    rank, world, next_port = _port_exchange()
    results = {}
    for i, run in enumerate(runs):
        if world == 1:
            for k in _RANK_ENV:  # main() sets up a one-rank job on a fresh port
                os.environ.pop(k, None)
        else:
            os.environ.update(MASTER_PORT=str(next_port(i)), TORCHELASTIC_USE_AGENT_STORE="False")
        _FP64_NORMS.clear()
        err, t0 = _Capture(), time.perf_counter()
        # main's error line goes to stderr, torchtitan's log to the stdout of init_logger's time
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            rc = _in_fresh_thread(train.main, run["argv"])
        wall = time.perf_counter() - t0
        sys.stderr.write(err.getvalue())
        folder = Path(run["argv"][run["argv"].index("--dump_folder") + 1])
        hist, summary = folder / "loss_history.json", folder / "summary.json"
        results[run["name"]] = {
            "rc": rc,
            "wall_s": wall,
            "output": err.getvalue(),
            "history": json.loads(hist.read_text()) if hist.exists() else None,
            "val_history": (
                json.loads(summary.read_text())["val_history"] if summary.exists() else None
            ),
            "grad_norm_fp64": list(_FP64_NORMS),
        }
    if rank == 0:
        out = {"environment": environment(), "runs": results}
        Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
