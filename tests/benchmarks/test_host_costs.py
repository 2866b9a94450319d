"""``benchmarks.host_costs``: every compiled sublayer form a routed model hands its sublayers is
timed (plain, a block end's cast, a merge), the phase-1 read at the model's source counts, and
one forward split between the router and the sublayer calls; the table shows each."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import host_costs
from benchmarks.overhead import Shape

SHAPE = Shape(layers=2, dim=32, seq=8, heads=2, vocab=256)


@pytest.fixture(scope="module")
def result():
    return host_costs.measure(SHAPE, ["baseline", "sliced2_r8"], calls=2, progress=lambda _: None)


def test_every_form_is_timed(result):
    base, routed = result["baseline"], result["sliced2_r8"]
    assert set(base["sublayers"]) == {"attention plain", "mlp plain"}
    assert "phase1" not in base
    # 4 sublayers, ends at 2 and 4: site 0 plain, sublayer 3 reads a block end, 2 and 4 merge
    assert set(routed["sublayers"]) == {"attention plain", "attention cast", "mlp merge"}
    assert set(routed["phase1"]) == {1, 2}  # 1 source (e), 2 (e and the first block)
    # times only, never compared across calls: a shared machine may slow any one of them
    for row in (base, routed):
        for t in (*row["sublayers"].values(), *row.get("phase1", {}).values()):
            assert set(t) == {"forward", "forward_backward"}
            assert all(0 < v < math.inf for v in t.values())
        f = row["forward_ms"]  # one forward's own parts: nested timers, so they fit inside it
        assert f["forward"] >= f["router"] + f["sublayers"] > 0 and f["router"] > 0


def test_table_and_json(result, tmp_path, monkeypatch):
    text = host_costs.table(result)
    assert "| sliced2_r8 | sublayer: mlp merge |" in text
    assert "| sliced2_r8 | phase-1 read, 2 sources |" in text
    assert "| baseline | " in text.split("forward ms")[1]
    monkeypatch.setattr(host_costs, "measure", lambda *a, **k: result)
    path = tmp_path / "h.json"
    assert host_costs.main(["--variants", "baseline,sliced2_r8", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["config"]["variants"] == "baseline,sliced2_r8" and "torch" in saved["config"]
    assert set(saved["result"]) == {"baseline", "sliced2_r8"}
