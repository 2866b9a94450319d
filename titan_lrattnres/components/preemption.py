"""Preemption: a scheduler's signal ends a run with a checkpoint of the step it was in, not with
the steps since the last interval save lost.

On SIGTERM, or the signal ``--preemption.signal`` names (schedulers that warn ahead: SLURM's
``--signal=USR1@120``), the handler only notes the signal: every rank finishes the step it is in.
After each step all ranks ask, in one ``all_reduce``, whether any rank was signalled, so all of
them stop after the same step (a rank the launcher signalled late, or not at all, included). The
trainer then saves that step synchronously, logs one line and exits with :data:`EXIT_CODE`.

A watchdog thread sees every signal as it arrives (through ``signal.set_wakeup_fd``, written
by the C-level handler even while the main thread is blocked in a save or a collective). A second
signal ends the process at once (exit code 128 + the signal), except within
:data:`REPEAT_WINDOW_S` of the first: under SLURM the launcher and its workers are signalled
together and torchrun then passes its own signal on, so a worker can get one preemption twice.
The watchdog also ends the run when the step and the save have not finished within
``grace_seconds`` of the signal, saying so; the save it interrupts stays marked unfinished
(:mod:`titan_lrattnres.components.integrity`), so the last complete checkpoint is what a rerun
resumes from.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure; the same command resumes
MARKER = "preempted.json"  # in the dump folder: a job script under torchrun tests for it
REPEAT_WINDOW_S = 2.0  # a signal this soon after the first is the same preemption delivered twice
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


@dataclass(kw_only=True, slots=True)
class PreemptionConfig:
    enable: bool = True
    """Save and exit on SIGTERM (and ``signal``); only when checkpointing is enabled."""

    signal: str = ""
    """A second signal that preempts, e.g. SIGUSR1 (a scheduler's warning ahead of SIGTERM)."""

    grace_seconds: float = 25.0
    """Seconds from the signal for the step and the save; past them the run exits without the
    save (the last complete checkpoint stays). Keep it under the scheduler's kill delay (SLURM's
    KillWait, torchrun's --shutdown-timeout: 30 s by default; the lead time of --signal)."""


class Preempted(SystemExit):
    """The run was preempted and exits with :data:`EXIT_CODE`; ``message`` is its one line."""

    def __init__(self, message: str):
        super().__init__(EXIT_CODE)
        self.message = message


def parse_signal(name: str) -> signal.Signals:
    """``SIGUSR1``, ``USR1``, ``usr1`` or ``10``; ValueError in one line for anything else."""
    raw = name.strip()
    try:
        sig = signal.Signals(int(raw)) if raw.isdigit() else signal.Signals[_canonical(raw)]
    except (KeyError, ValueError):
        raise ValueError(
            f"--preemption.signal {name!r} is not a signal name (e.g. SIGUSR1, SIGUSR2, SIGTERM)"
        ) from None
    if sig in _UNCATCHABLE:
        raise ValueError(f"--preemption.signal {sig.name} cannot be caught; use e.g. SIGUSR1")
    return sig


def _canonical(raw: str) -> str:
    upper = raw.upper()
    return upper if upper.startswith("SIG") else "SIG" + upper


def signals_of(config: PreemptionConfig) -> list[signal.Signals]:
    """SIGTERM and the configured signal, without repeats."""
    out = [signal.SIGTERM]
    if config.signal:
        sig = parse_signal(config.signal)
        if sig not in out:
            out.append(sig)
    return out


class PreemptionHandler:
    """The signal handlers, the step agreement and the watchdog of one run (one per process)."""

    def __init__(
        self,
        signals: list[signal.Signals],
        grace_seconds: float,
        on_expiry: Callable[[str], str],
        *,
        poll_s: float = 0.1,
        repeat_window_s: float = REPEAT_WINDOW_S,
    ):
        self.signals, self.grace_s, self.poll_s = signals, grace_seconds, poll_s
        self.repeat_window_s = repeat_window_s
        self.on_expiry = on_expiry  # (what was under way) -> the line to log
        self.received: signal.Signals | None = None  # on this rank
        self.started_at: float | None = None  # when this rank learnt of it (monotonic)
        self.phase = "the step in progress"
        self._previous: dict[signal.Signals, object] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._first_seen: float | None = None  # by the watchdog
        self._finished = threading.Event()
        self._group = None
        self._watchdog: threading.Thread | None = None

    # -- installing ---------------------------------------------------------------------------
    def install(self) -> bool:
        """Set the handlers (main thread only: Python delivers signals there) and the group for
        the agreement; every rank calls it (the group may be a collective). False when off."""
        import torch.distributed as dist

        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption handling needs the main thread: off for this run")
            return False
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a CPU flag: no device sync per step
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd requires it
        self._pipe = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._watchdog = threading.Thread(target=self._watch, name="preemption-watchdog")
        self._watchdog.daemon = True
        self._watchdog.start()
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the watchdog."""
        self._finished.set()
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            if self._watchdog is not None:
                self._watchdog.join()
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _on_signal(self, signum, frame) -> None:
        # no logging here: the main thread may be inside a write to the same stream
        if self.received is None:
            self.received = signal.Signals(signum)
            self.started_at = time.monotonic()

    # -- agreeing -----------------------------------------------------------------------------
    def requested(self) -> bool:
        """Whether any rank was signalled (every rank calls it after each step: one
        ``all_reduce``). A rank that learns of it here starts its grace period now."""
        import torch
        import torch.distributed as dist

        flag = self.received is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([int(flag)], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            flag = bool(t.item())
        if flag and self.started_at is None:
            self.started_at = time.monotonic()
        return flag

    def describe(self) -> str:
        """The signal as the log names it."""
        return self.received.name if self.received is not None else "a signal to another rank"

    def finish(self) -> None:
        """The save is done: the watchdog stands down."""
        self._finished.set()

    # -- the watchdog -------------------------------------------------------------------------
    def _watch(self) -> None:
        read = self._pipe[0]
        while not self._finished.is_set():
            ready, _, _ = select.select([read], [], [], self.poll_s)
            if ready:
                for signum in os.read(read, 64):
                    if signum in self.signals:
                        self._seen(signal.Signals(signum))
            t0 = self.started_at
            if t0 is not None and time.monotonic() - t0 > self.grace_s:
                if not self._finished.is_set():
                    self._exit(self.on_expiry(self.phase), EXIT_CODE)
                return

    def _seen(self, sig: signal.Signals) -> None:
        now = time.monotonic()
        if self._first_seen is None:
            self._first_seen = now
        elif now - self._first_seen > self.repeat_window_s:
            self._exit(f"a second {sig.name}: exiting at once, nothing saved", 128 + sig)

    def _exit(self, line: str | None, code: int) -> None:
        try:
            if line:
                log.warning(line)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: S110 (exiting anyway)
                    pass
            os._exit(code)
