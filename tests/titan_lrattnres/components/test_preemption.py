"""The preemption handler: which signals, what the first and a second one do, the agreement and
the watchdog. The trainer runs (a signal at a chosen step, 1 and 2 ranks, the grace period) are
in ``training/test_preemption_runs.py``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from titan_lrattnres import train
from titan_lrattnres.components import preemption

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["SIGUSR1", "usr1", "USR1", str(int(signal.SIGUSR1))])
def test_signal_names(name):
    assert preemption.parse_signal(name) is signal.SIGUSR1


@pytest.mark.parametrize("name, why", [("SIGKILL", "cannot be caught"), ("FOO", "not a signal")])
def test_bad_signals_are_refused_in_one_line(name, why):
    with pytest.raises(ValueError, match=f"--preemption.signal .*{why}"):
        preemption.parse_signal(name)


def test_sigterm_always_and_the_named_one_once():
    cfg = preemption.PreemptionConfig
    assert preemption.signals_of(cfg()) == [signal.SIGTERM]
    assert preemption.signals_of(cfg(signal="TERM")) == [signal.SIGTERM]
    assert preemption.signals_of(cfg(signal="SIGUSR1")) == [signal.SIGTERM, signal.SIGUSR1]


def test_the_entry_point_refuses_a_bad_signal(capsys):
    argv = ["cpu_smoke", "--dump_folder", "/nonexistent/x", "--preemption.signal", "SIGSTOP"]
    assert train.main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert err == ["error: --preemption.signal SIGSTOP cannot be caught; use e.g. SIGUSR1"]


@pytest.fixture
def handler():
    made = []

    def make(grace=60.0, on_expiry=lambda phase: f"expired during {phase}"):
        h = preemption.PreemptionHandler([signal.SIGTERM, signal.SIGUSR1], grace, on_expiry,
                                         poll_s=0.02)  # fmt: skip
        made.append(h)
        return h

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield make
    for h in made:
        h.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_first_signal_is_only_noted(handler):
    h = handler()
    assert h.install() and not h.requested() and h.describe() == "a signal to another rank"
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while h.received is None and time.monotonic() < deadline:
        time.sleep(0.01)  # Python runs the handler between bytecodes of the main thread
    assert h.received is signal.SIGUSR1 and h.requested() and h.describe() == "SIGUSR1"
    assert h.started_at is not None


def test_off_the_main_thread_nothing_is_installed(handler, caplog):
    h, out = handler(), []
    t = threading.Thread(target=lambda: out.append(h.install()))
    t.start()
    t.join()
    assert out == [False] and "needs the main thread" in caplog.text


def test_the_watchdog_exits_75_after_the_grace_period(handler, monkeypatch, caplog):
    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    h = handler(grace=0.1)
    h.install()
    h.phase = "the save of step-3"
    with caplog.at_level(logging.WARNING):
        h.started_at = time.monotonic()  # as the signal handler does
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    assert exits == [preemption.EXIT_CODE] == [75]
    assert "expired during the save of step-3" in caplog.text


def test_a_finished_save_stops_the_watchdog(handler, monkeypatch):
    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    h = handler(grace=0.1)
    h.install()
    h.started_at = time.monotonic()
    h.finish()
    time.sleep(0.3)
    assert exits == []


def test_a_repeat_within_the_window_is_the_same_preemption(handler, monkeypatch):
    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    h = handler()
    h.repeat_window_s = 0.3
    h.install()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher passing on the scheduler's signal
    time.sleep(0.2)
    assert exits == [] and h.received is signal.SIGTERM
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGUSR1)  # past the window: a second signal
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [128 + signal.SIGUSR1]


SECOND_SIGNAL = textwrap.dedent("""
    import os, signal, time
    from titan_lrattnres.components import preemption
    h = preemption.PreemptionHandler([signal.SIGTERM], 60, lambda phase: None, poll_s=0.01,
                                     repeat_window_s=0.2)
    assert h.install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    print("noted", h.received.name, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # busy: the watchdog acts without the main thread
    print("still alive", flush=True)
""")


def test_a_second_signal_ends_the_process_at_once():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["noted SIGTERM"] and time.monotonic() - t < 25
    assert "a second SIGTERM: exiting at once, nothing saved" in p.stderr
