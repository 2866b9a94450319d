"""Muon under tensor parallel: which block of each matrix a rank holds (DTensor's ``Shard`` and
``_StridedShard`` rules, fast), and 8 gloo ranks (``muon_dist_worker.py ... tp``, slow) where a
tiny layer's weights laid out as torchtitan 0.3.0 lays them out (TP styles + FSDP2) train 3 steps
with fused ``[w1; w3]`` exactly as in one process, PP2 x FSDP2 x TP2, HSDP 2x2 x TP2, TP2 on the
trainer's ``(dp_shard=1, tp=2)`` mesh and TP2 alone; a DCP resume at TP2."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.titan_lrattnres.muon_dist_worker import launch as launch_worker
from titan_lrattnres.components.muon import held


@pytest.mark.parametrize("n", [0, 1, 5, 30, 37])
@pytest.mark.parametrize("parts, split_factor", [(1, 2), (2, 1), (2, 2), (3, 2), (2, 4)])
def test_held_follows_dtensor_splitting(n, parts, split_factor):
    """``held`` against DTensor's own split of an index vector (uneven and empty shards)."""
    idx = torch.arange(n)
    pl = _StridedShard(0, split_factor=split_factor) if split_factor > 1 else Shard(0)
    shards, _ = pl._split_tensor(idx, parts, with_padding=False)
    for coord in range(parts):
        assert held(list(range(n)), parts, coord, split_factor) == shards[coord].tolist()


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp("muon_tp"), 8, "tp", timeout=600)


# what torchtitan 0.3.0's trainer gives the model's weights under FSDP2 x TP (and at TP alone,
# with a dp_shard dim of 1): column-wise, row-wise, replicated over TP
COLWISE = ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
ROWWISE = ["Shard(dim=0)", "Shard(dim=1)"]
TP_REPLICATED = ["Shard(dim=0)", "Replicate()"]
TORCHTITAN = {
    "attention.wqkv.weight": COLWISE,
    "attention.wo.weight": ROWWISE,
    "feed_forward.w1.weight": COLWISE,
    "feed_forward.w2.weight": ROWWISE,
    "feed_forward.w3.weight": COLWISE,
    "embedding_key.weight": TP_REPLICATED,
}
CASES = ["pp2_fsdp2_tp2_float32", "pp2_fsdp2_tp2_bfloat16", "hsdp2x2_tp2_float32"]
CASES += ["tp2_float32", "tp2_bfloat16", "tp2_plain_float32"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_layouts_equal_one_process(eight_ranks, case):
    """Every matrix is orthogonalised whole by its owner, which assembles exactly the
    one-process matrix: weights, momentum and NorMuon statistics after 3 steps are bitwise the
    one-process ones in fp32 and bf16 (tolerance 0: a block assembled in the wrong place and
    returned there moves the weights by rounding only, measured 7e-8, while the statistics of
    the wrong rows are stored, measured 1.4e-3), in one all-to-all out and one back per step."""
    for rank, r in enumerate(eight_ranks):
        got = r[case]
        assert got["at_start"] == 0.0 and got["max_abs_diff"] == 0.0, (rank, got)
        assert got["state_max_abs_diff"] == 0.0, (rank, got)
        assert got["collectives_per_step"] == 2.0 and got["momentum_as_param"]
    stages = [r["stage"] for r in eight_ranks]  # PP2: ranks 0-3 hold stage 0, 4-7 stage 1
    assert stages == [0] * 4 + [1] * 4


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pp2_fsdp2_tp2_float32", "tp2_float32"])
def test_layouts_are_torchtitans(eight_ranks, case):
    """The worker's TP styles + ``fully_shard`` give the placements torchtitan's trainer gives;
    the statistics are sharded along their long dim by every mesh dim sharding the weight."""
    r = eight_ranks[0][case]
    assert r["placements"] == TORCHTITAN
    tall_rows, wide_cols = ["S(0)", "S(0)"], ["S(1)", "S(1)"]
    assert r["variance"] == {
        "attention.wqkv.weight": [*tall_rows, [30, 1]],
        "attention.wo.weight": [*tall_rows, [24, 1]],
        "feed_forward.w1.weight": [*tall_rows, [37, 1]],
        "feed_forward.w2.weight": [*wide_cols, [1, 37]],
        "feed_forward.w3.weight": [*tall_rows, [37, 1]],
        "embedding_key.weight": ["S(1)", "R", [1, 24]],
    }
    # stage 1: a wide fused [w1; w3] keeps one column statistic per member
    wide = eight_ranks[4]["pp2_fsdp2_tp2_float32"]["variance"]
    assert wide["feed_forward.w1.weight"] == wide["feed_forward.w3.weight"] == [*wide_cols, [1, 24]]


@pytest.mark.slow
def test_tp2_dcp_resume_gives_the_uninterrupted_step(eight_ranks):
    """Model and optimiser state saved with DCP at TP2 and loaded into fresh ones: the next step
    is bitwise the uninterrupted run's; without the optimiser state it is not."""
    for r in eight_ranks:
        assert r["tp2_resume"] == {
            "bitwise": True,
            "without_state_equal": False,
            "state_kept": True,
        }


@pytest.mark.slow
def test_muon_refuses_layouts_it_cannot_take(eight_ranks):
    got = eight_ranks[0]["refusals"]
    assert got["partial"] == (
        "Muon takes parameters sharded or replicated on each mesh dim, got (Partial(sum),)"
    )
    assert got["cube_by_columns"] == (
        "Muon takes a >2-D weight sharded by dim 0 only, got (Shard(dim=1),)"
    )
    assert got["wrong_local_shape"].startswith(
        "Muon: a local shard of shape (3, 4) is not the 4 x 4"
    )
