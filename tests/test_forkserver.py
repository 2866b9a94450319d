"""The fork server gives a command what ``subprocess.run`` gives it: argv, environment, working
directory, ``sys.path[0]``, ``__main__``, output, exit code; under ``torch.distributed.run`` the
ranks' variables, a working process group, a failure that stops the other ranks; a timeout."""

import os
import subprocess
import sys
import time

import pytest

from tests import forkserver

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "name", __name__)
print("env", os.environ.get("FS_PROBE"), "data", os.environ.get("LRATTNRES_DATA_DIR"))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""

RANKS = """
import os, signal, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
if sys.argv[1:] == ["fail"]:  # rank 1 fails at once, rank 0 would wait
    sys.exit(7) if rank == 1 else time.sleep(600)
if sys.argv[1:] == ["fail_deaf"]:  # the same, rank 0 ignoring SIGTERM
    if rank == 1:
        time.sleep(1)
        sys.exit(7)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
dist.init_process_group("gloo")
t = torch.tensor([float(rank)])
dist.all_reduce(t)
line = f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} sum {t.item()}"
os.write(1, (line + "\\n").encode())  # one write: the ranks share stdout
dist.destroy_process_group()
"""


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if k not in forkserver.RUN_TIME}
    return dict(e, PYTHONPATH=str(forkserver.ROOT), OMP_NUM_THREADS="1", FS_PROBE="probe")


def _both(cmd, env, cwd):
    want = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    got = forkserver.run(cmd, env=env, cwd=cwd, timeout=120)
    return got, want


@pytest.mark.parametrize("code", [0, 3])
def test_script_and_module_match_subprocess(env, tmp_path, code):
    pkg = tmp_path / "fsprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(SCRIPT)
    env = dict(env, LRATTNRES_DATA_DIR=str(tmp_path / "data"))
    for cmd in (
        [sys.executable, str(pkg / "main.py"), "a", "--b=c", str(code)],
        [sys.executable, "-m", "fsprobe.main", "x", str(code)],
    ):
        got, want = _both(cmd, env, cwd=tmp_path)
        assert (got.returncode, got.stdout, got.stderr) == (code, want.stdout, want.stderr)
        assert "probe" in got.stdout and str(tmp_path / "data") in got.stdout
    assert forkserver.parse([sys.executable, "-m", "fsprobe.main"]) is not None


def test_unsupported_commands_run_as_subprocesses(env, tmp_path):
    cmd = [sys.executable, "-c", "import sys; print(sys.argv)"]
    assert forkserver.parse(cmd) is None
    got, want = _both(cmd, env, cwd=tmp_path)
    assert (got.returncode, got.stdout) == (0, want.stdout)


def _torchrun(script, *args):
    launch = ["-m", "torch.distributed.run", "--nproc_per_node=2"]
    return [sys.executable, *launch, "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
            str(script), *args]  # fmt: skip


def test_ranks_get_torchrun_variables_and_a_process_group(env, tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS)
    cmd = _torchrun(tmp_path / "ranks.py")
    assert forkserver.parse(cmd)["nproc"] == 2
    got = forkserver.run(cmd, env=env, cwd=tmp_path, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = sorted(line for line in got.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 local 0 sum 1.0", "rank 1 of 2 local 1 sum 1.0"]


@pytest.mark.parametrize("how", ["fail", "fail_deaf"])
def test_a_failing_rank_stops_the_others(env, tmp_path, how):
    """SIGTERM to the others, SIGKILL ``grace`` seconds later (rank 0 sleeps 600 s)."""
    (tmp_path / "ranks.py").write_text(RANKS)
    t0 = time.monotonic()
    got = forkserver.run(_torchrun(tmp_path / "ranks.py", how), env=env, timeout=120, grace=2)
    assert got.returncode == 7
    assert time.monotonic() - t0 < 60


def test_timeout_kills_the_command(env, tmp_path):
    (tmp_path / "sleep.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run([sys.executable, str(tmp_path / "sleep.py")], env=env, timeout=3)
    assert e.value.output == "up\n"
    # the server is free again
    again = forkserver.run([sys.executable, "-m", "tests.forkserver_probe"], env=env, timeout=60)
    assert again.returncode == 1 and "No module named tests.forkserver_probe" in again.stderr
