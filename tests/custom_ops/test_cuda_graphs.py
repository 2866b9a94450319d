"""CUDA-graph capture and replay of the Triton read (forward + backward) and merge: capture,
change every input in place, replay, compare with a fresh eager call (``benchmarks.gpu_parity``,
the same check ``benchmarks/gpu_check.sh`` runs). Needs a CUDA device; skipped, with the reason,
everywhere else (the capture-safety precondition, no host tensor built per launch, is tested on
CPU in ``tests/custom_ops_interp/test_kernel_inputs.py``)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)"
)


def test_read_and_merge_replay_after_inputs_change_in_place():
    from benchmarks.gpu_parity import graph_parity

    result = graph_parity(torch.device("cuda"), dry=False)
    bad = {k: v for k, v in result.items() if k != "all_ok" and not v.get("ok")}
    assert result["all_ok"] and not bad, bad
