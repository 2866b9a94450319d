"""Golden loss curves: five tiny deterministic fp32 runs (baseline, standard Full, standard Block,
sliced Block, projected Block; 20 steps, one process, one thread) through the real trainer, data,
loss, optimizer and LR schedule, against ``golden/curves.json``: bit for bit on the recorded
hardware, within a measured tolerance on other hardware (with a warning), refused with the
regeneration command under other software. How and why: ``golden/regen.py``.

Regenerate (after a change that is meant to move the curves, or for new versions):
``python -m tests.titan_lrattnres.golden.regen`` (``--add`` keeps other environments' entries).
"""

from __future__ import annotations

import warnings

import pytest

from tests.titan_lrattnres.golden import regen as golden

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, env):
    return golden.record(tmp_path_factory.mktemp("golden"), env)


@pytest.fixture(scope="module")
def stored_entry(fresh):
    try:
        entry, hardware = golden.match(golden.load(), fresh["environment"])
    except golden.NotComparable as e:
        pytest.fail(str(e), pytrace=False)
    if hardware:
        warnings.warn(
            "golden curves: recorded on other hardware ("
            + "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in hardware.items())
            + f"), compared within {golden.TOLERANCE} instead of bit for bit; `{golden.COMMAND}"
            " --add` records this machine's curves",
            stacklevel=1,
        )
    return entry, not hardware


@pytest.mark.parametrize("variant", golden.VARIANTS)
def test_golden_curve(fresh, stored_entry, variant):
    entry, bitwise = stored_entry
    problems = golden.compare(entry["curves"][variant], fresh["curves"][variant], bitwise=bitwise)
    how = "bit for bit" if bitwise else f"within {golden.TOLERANCE}"
    assert not problems, (
        f"{variant} differs from its golden curve ({how}):\n  "
        + "\n  ".join(problems[:8])
        + f"\nIf the change is intended, regenerate: {golden.COMMAND}"
    )


def test_runs_learn_and_routing_matters(fresh):
    """The curves are worth guarding: every run learns, and the routed variants differ from the
    baseline and from each other from the first steps (the depth maths moves the loss)."""
    curves = fresh["curves"]
    for v, c in curves.items():
        assert len(c["loss"]) == 20 and c["loss"][-1] < c["loss"][0] - 0.5, v
    finals = {v: c["loss"][-1] for v, c in curves.items()}
    assert len(set(finals.values())) == len(finals), finals


# --- the comparison rules (no training) ---------------------------------------------------

ENV = {k: "x" for k in golden.SOFTWARE + golden.HARDWARE}
CURVE = {"loss": [8.0, 7.5], "grad_norm": [1.0, 0.9], "val_loss": 7.4}


def test_other_software_is_refused_with_the_command():
    stored = {"entries": [{"environment": ENV, "curves": {}}]}
    with pytest.raises(golden.NotComparable, match="torch y.*regen"):
        golden.match(stored, {**ENV, "torch": "y"})
    with pytest.raises(golden.NotComparable, match="recorded: none"):
        golden.match({"entries": []}, ENV)


def test_other_hardware_uses_the_tolerance_and_says_so():
    here = {**ENV, "cpu_capability": "AVX512"}
    stored = {"entries": [{"environment": ENV, "curves": {}}]}
    entry, hardware = golden.match(stored, here)
    assert entry is stored["entries"][0] and hardware == {"cpu_capability": ("x", "AVX512")}
    exact = {"environment": here, "curves": {}}
    assert golden.match({"entries": [*stored["entries"], exact]}, here) == (exact, {})


def test_compare_is_bitwise_or_within_tolerance():
    assert golden.compare(CURVE, CURVE, bitwise=True) == []
    ulp = {**CURVE, "loss": [8.0, 7.5 * (1 + 1e-7)]}
    assert golden.compare(CURVE, ulp, bitwise=False) == []
    assert "loss at step 2" in golden.compare(CURVE, ulp, bitwise=True)[0]
    off = {**CURVE, "loss": [8.0, 7.5 * (1 + 2e-5)], "val_loss": 7.5}
    problems = golden.compare(CURVE, off, bitwise=False)
    assert len(problems) == 2 and "val_loss" in problems[1]
    assert (
        "1 steps recorded now" in golden.compare(CURVE, {**CURVE, "loss": [8.0]}, bitwise=True)[0]
    )
