"""Python commands for the tests, forked from a process that has already imported torch and
torchtitan's trainer: a trainer process spends ~7 s of CPU importing them, and the parity and
golden tests start over a hundred of them.

    run([sys.executable, "-m", MODULE, *args], env=ENV, timeout=S)
    run([sys.executable, SCRIPT, *args], ...)
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=N", ..., TARGET...])

returns what ``subprocess.run(..., capture_output=True, text=True)`` would. A forked command is
a process of its own: it gets the command's argv, environment, working directory and
``sys.path[0]``, runs its module or script as ``__main__`` and exits through the interpreter's
normal shutdown. Under ``torch.distributed.run`` it is N processes with the rank variables
``torchrun`` sets (rank 0 hosts the store, as without an agent); when one fails the others are
stopped, as ``torchrun`` does.

One server per pytest worker and per import environment: every variable but the few read only
at run time (:data:`RUN_TIME`) must match, since torch and its libraries read theirs (thread
counts, logging, offline modes) at import. Anything else (other flags, ``-c``, other programs)
runs as a plain subprocess. Tests that check what a command prints at import time must use
``subprocess`` itself: a forked command does not import again.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torchtitan.trainer")
# Read only when a command runs: commands may differ in these and share a server.
RUN_TIME = frozenset(
    {"LRATTNRES_DATA_DIR", "TORCHINDUCTOR_CACHE_DIR", "TP_DUMP", "TP_GRADS", "PYTEST_CURRENT_TEST"}
)
_TORCHRUN_FLAGS = frozenset({"--nproc_per_node", "--rdzv_backend", "--rdzv_endpoint"})


def parse(cmd: list[str]) -> dict | None:
    """``{"target": ("-m", MODULE) | ("path", SCRIPT), "args": [...], "nproc": N}``, or None for
    a command this server does not run."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    rest, nproc = list(cmd[1:]), 1
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        while rest and rest[0].startswith("--"):
            flag, _, value = rest.pop(0).partition("=")
            if flag not in _TORCHRUN_FLAGS or (not value and not rest):
                return None
            value = value or rest.pop(0)
            if flag == "--nproc_per_node":
                nproc = int(value)
    if rest[:1] == ["-m"] and len(rest) > 1:
        return {"target": ["-m", rest[1]], "args": rest[2:], "nproc": nproc}
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return {"target": ["path", rest[0]], "args": rest[1:], "nproc": nproc}
    return None


# ---------------------------------------------------------------- the server (its own process)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(job: dict, rank: int, pgid: int, reply) -> dict:
    """In a forked process: become the job's process (fds, cwd, environment); returns ``job``."""
    reply.close()
    try:
        os.setpgid(0, pgid)
    except OSError:  # rank 0 has exited: stay in the server's group
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(job["stdout"], os.O_WRONLY | os.O_APPEND)
    err = os.open(job["stderr"], os.O_WRONLY | os.O_APPEND)
    for fd, to in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, to)
        os.close(fd)
    os.chdir(job["cwd"])
    env = dict(job["env"])
    if job["nproc"] > 1:
        n = str(job["nproc"])
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
        env.update(GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=n, GROUP_WORLD_SIZE="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
        env.update(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="False")
    os.environ.clear()
    os.environ.update(env)
    return job


def _wait(pids: list[int], grace: float) -> int:
    """Wait for a job's processes. The first failure stops the others as torchrun does: SIGTERM,
    then SIGKILL after ``grace`` seconds. Its exit code (as ``subprocess`` gives it: ``-signal``
    when killed), else 0."""
    rc, alive, deadline = 0, set(pids), None
    while alive:
        pid, status = os.waitpid(-1, 0 if deadline is None else os.WNOHANG)
        if pid == 0:  # stopping the others: not yet
            if time.monotonic() > deadline:
                for other in alive:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in alive:
            continue
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not rc:
            rc, deadline = code, time.monotonic() + grace
            for other in alive:
                os.kill(other, signal.SIGTERM)
    return rc


def serve(requests, reply_fd: int) -> dict:
    """Fork each request's processes; in the parent, loop until the requests end (then exit);
    in a forked process, return its job."""
    for name in PRELOAD:
        __import__(name)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write("ready\n")
    for line in requests:
        job = json.loads(line)
        if job["nproc"] > 1:
            job["port"] = free_port()
        sys.stdout.flush(), sys.stderr.flush()
        pids: list[int] = []
        for rank in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                return _child(job, rank, pids[0] if pids else 0, reply)
            try:
                os.setpgid(pid, pids[0] if pids else pid)
            except OSError:  # already done by the child, or it has exited
                pass
            pids.append(pid)
        reply.write(json.dumps({"pgid": pids[0]}) + "\n")
        reply.write(json.dumps({"rc": _wait(pids, job["grace"])}) + "\n")
    sys.exit(0)


def _run_job(job: dict):
    kind, name = job["target"]
    sys.argv = [name, *job["args"]]
    if kind == "-m":
        sys.path[0] = job["cwd"]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(name))
        runpy.run_path(name, run_name="__main__")


# ------------------------------------------------------------------ the client (the test process)


class _Server:
    def __init__(self, env: dict):
        self.dir = Path(tempfile.mkdtemp(prefix="forkserver_"))
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        read_fd, write_fd = os.pipe()
        self.log = open(self.dir / "server.log", "w")  # noqa: SIM115 (lives with the server)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(write_fd)],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=self.log,
            pass_fds=(write_fd,),
            text=True,
        )
        os.close(write_fd)
        self.replies, self.pending = read_fd, b""
        self.count = 0
        self._expect("ready", timeout=300)

    def _expect(self, what: str, timeout: float | None):
        """The server's next reply line (``ready``, or ``what`` from a JSON line); None when
        ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.replies], [], [], left)[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                log = (self.dir / "server.log").read_text()[-4000:]
                raise RuntimeError(f"the fork server exited (rc {self.proc.poll()}): {log}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode() if what == "ready" else json.loads(line)[what]

    def run(self, cmd, job: dict, timeout: float | None) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.dir / f"{self.count}.out", self.dir / f"{self.count}.err"
        out.write_text(""), err.write_text("")
        job = dict(job, stdout=str(out), stderr=str(err))
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pgid = self._expect("pgid", timeout=60)
        start = time.monotonic()
        rc = self._expect("rc", timeout=timeout)
        if rc is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(pgid, signal.SIGKILL)
            self._expect("rc", timeout=60)
            raise subprocess.TimeoutExpired(cmd, time.monotonic() - start, out.read_text(),
                                            err.read_text())  # fmt: skip
        result = subprocess.CompletedProcess(cmd, rc, out.read_text(), err.read_text())
        out.unlink(), err.unlink()
        return result


_SERVERS: dict[frozenset, _Server] = {}


def run(cmd: list[str], *, env: dict, cwd=ROOT, timeout: float | None = None, run_time=(),
        grace: float = 30.0):  # fmt: skip
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)``, forked from a server when the command is one it runs (see the module).
    ``run_time``: more variables than :data:`RUN_TIME` that the command reads only once running
    (a test driver's own). ``grace``: when a rank fails, seconds from SIGTERM to SIGKILL for the
    others (torchrun's default)."""
    job = parse(cmd)
    if job is None:
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    imported = {k: v for k, v in env.items() if k not in RUN_TIME and k not in run_time}
    key = frozenset(imported.items())
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        _SERVERS[key] = _Server(imported)
    job.update(env=dict(env), cwd=str(Path(cwd).resolve()), grace=grace)
    return _SERVERS[key].run(cmd, job, timeout)


if __name__ == "__main__":
    sys.exit(_run_job(serve(sys.stdin, int(sys.argv[1]))))
