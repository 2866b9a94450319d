"""``benchmarks.cpu_kernels``: the A/B of two builds of the CPU kernels runs (kernel calls and
the model's steps), times the same work in both (results compared), and refuses a revision
without the kernel source, or a bad model shape or variant, in one line."""

from __future__ import annotations

import pytest

from benchmarks import cpu_kernels
from custom_ops import cpu


def test_compare_times_every_kernel_of_both_libraries(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "SHAPES", {"tiny": ("projected", 3, 2, 70, 40, 8)})
    lib = cpu.library()
    assert lib is not None
    rows = cpu_kernels.compare({"a": lib, "b": lib}, reps=2)
    assert [r["kernel"] for r in rows] == list(cpu_kernels.KERNELS)
    for r in rows:
        assert r["a"] > 0 and r["b"] > 0 and r["ratio"] == pytest.approx(r["b"] / r["a"])
        assert r["rel_diff"] == 0.0  # one library against itself: bit for bit
    assert cpu.library() is lib  # the package's own library is back


def test_model_steps_alternate_between_the_libraries():
    from benchmarks.overhead import Shape

    lib = cpu.library()
    shape = Shape(layers=1, dim=64, seq=32, heads=2, vocab=256)
    rows = cpu_kernels.compare_model({"a": lib, "b": lib}, shape, ["sliced2_r16"], 2, False)
    (row,) = rows
    assert row["variant"] == "sliced2_r16" and row["a"] > 0 and row["b"] > 0
    assert row["loss_rel_diff"] == 0.0  # one library against itself
    assert cpu.library() is lib


def test_model_steps_report_each_depth_op_in_place():
    from benchmarks.overhead import Shape

    lib = cpu.library()
    shape = Shape(layers=2, dim=64, seq=32, heads=2, vocab=256)
    (row,) = cpu_kernels.compare_model(
        {"a": lib, "b": lib}, shape, ["sliced2_r16"], 2, False, ops=True
    )
    ops = row["ops"]
    # 2 layers, each a phase-1 read for its two sites, forward and backward (the merges with
    # the partial are aten ops)
    assert {"lrattnres::block_read_sliced", "lrattnres::read_backward"} <= set(ops)
    for name, ms in ops.items():
        assert ms["a"] > 0 and ms["b"] > 0, name


@pytest.mark.parametrize(
    "bad", [["--model", "24,1024"], ["--model", "2,64,32", "--variants", "x"], ["--ops"]]
)
def test_bad_model_arguments_are_refused(bad):
    with pytest.raises(SystemExit) as e:
        cpu_kernels.main(bad)
    assert e.value.code == 2


def test_the_kernels_of_a_revision_build(tmp_path):
    source = cpu_kernels._source_at("HEAD", tmp_path)
    assert cpu.build(source) is not None


def test_a_revision_without_the_kernels_is_refused(capsys):
    assert cpu_kernels.main(["--against", "no-such-revision-xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpu_kernels: no custom_ops/cpu/depth_read.c at 'no-such-revision-xyz'")
    assert "\n" not in err
