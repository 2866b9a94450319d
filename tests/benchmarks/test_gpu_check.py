"""The GPU check's CPU dry run end to end (every section, through gpu_check.sh), and the torch
compatibility module: a no-op on the pinned torch, the three patches where the pieces are
missing (simulated by removing them from torch 2.14.1 in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_lrattnres.components import data

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "benchmarks" / "torch_compat"
SECTIONS = ["ops_check", "grad_parity", "graph_parity", "trainer", "context_parallel",
            "memory", "op_bandwidth", "step_ratios", "decode", "step_ratios_cuda_graphs",
            "peers"]  # fmt: skip


def _env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    e.update(extra)
    return e


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    cache = tmp_path / "data_cache"  # a tiny corpus: the Trainer section needs one
    files = data.stdlib_files()
    train = [f for f in files if not data.is_validation(f[0])][:40]
    val = [f for f in files if data.is_validation(f[0])][:6]
    data.build_corpus(data.corpus_dir(cache), train + val, vocab_size=512)
    out = tmp_path / "dry.json"
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"],
        env=_env(
            PYTHON=sys.executable,
            LRATTNRES_DATA_DIR=str(cache),
            TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
            LRATTNRES_WHEEL_SITE=str(tmp_path / "site"),
        ),  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["device"] == "cpu" and "note" in r
    for name in SECTIONS:
        assert "error" not in r[name], (name, r[name]["error"])
    assert r["ops_check"]["all_ok"] and r["grad_parity"]["all_ok"]
    # every gradient of the two-phase ops is compared, not only the output
    merge = r["grad_parity"]["merge_partial/compiled/float32/projected"]["rel_err"]
    assert {"d_out1", "d_lse1", "d_partial_value", "d_partial_key", "d_query"} <= set(merge)
    assert "CUDA" in r["graph_parity"]["skipped"]
    assert "CUDA" in r["step_ratios_cuda_graphs"]["skipped"]
    # CP=2 against one process on 2 gloo ranks, the dry run's one case
    assert r["context_parallel"]["all_ok"] and list(r["context_parallel"]["results"]) == [
        "sliced_block"
    ]
    assert r["trainer"]["rc"] == 0 and r["trainer"]["summary"]["steps"] == 3
    # memory: every variant's real step beside the prediction (on the CPU the real peak is the
    # profiler's count of allocations, which the prediction matches within 1 %)
    mem = r["memory"]["measured_over_predicted"]
    assert list(mem) == ["baseline", "block8", "sliced8_r64", "projected8_r32", "full"]
    assert all(abs(ratio - 1) < 0.01 for ratio in mem.values()), mem
    assert r["memory"]["prediction"]["rc"] == 0 and "predicted MiB" in r["memory"]["table"]
    assert set(r["step_ratios"]["overhead_pct"]) == {"sliced8_r64", "projected8_r32"}
    for v, (lo, hi) in r["step_ratios"]["overhead_ci95_pct"].items():
        assert lo <= r["step_ratios"]["overhead_pct"][v] <= hi
    ratios = r["decode"]["decode_ratio"]  # every variant, both batch sizes, vs the baseline
    assert list(ratios) == ["eager B=1", "eager B=2"]  # the dry run: eager only
    assert all(b["baseline"] == 1.0 for b in ratios.values())
    assert all(set(b) == set(r["decode"]["config"]["variants"]) for b in ratios.values())
    assert all("CUDA" in v for k, v in r["peers"]["versions"].items())
    assert [row["impl"] for row in r["peers"]["rows"]] == ["ours", "ours"]
    assert r["targets"] and all(t["ok"] is None for t in r["targets"])  # tiny CPU: not judged
    # torch 2.14.1: the compat folder stays off PYTHONPATH
    assert r["versions"]["torch_compat_patches"] is None
    assert "[gpu_check] OK" in p.stdout


def _compat(prelude: str, after: str = "") -> list[str]:
    """APPLIED after loading sitecustomize from the compat folder between ``prelude`` and
    ``after`` (whose asserts fail the subprocess)."""
    path = str(COMPAT / "sitecustomize.py")
    code = textwrap.dedent(prelude) + textwrap.dedent(f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("sitecustomize", {path!r})
        mod = sys.modules["sitecustomize"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    """) + textwrap.dedent(after) + "\nprint(json.dumps(mod.APPLIED))\n"  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_compat_is_a_no_op_on_the_pinned_torch():
    assert _compat("") == []


def test_compat_patches_what_an_older_torch_lacks():
    applied = _compat("""
        import torch.distributed as dist, torch.distributed.fsdp as fsdp
        import torch.nn.attention.flex_attention as flex
        del fsdp.DataParallelMeshDims, dist.set_timeout
        real = flex.create_block_mask
        def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda"):  # 2.11's keywords
            return real(mask_mod, B, H, Q_LEN, KV_LEN, device=device)
        flex.create_block_mask = create_block_mask
    """, after="""
        assert fsdp.DataParallelMeshDims(shard="dp").shard_names == ("dp",)
        assert fsdp.DataParallelMeshDims(replicate=("a", "b")).replicate_names == ("a", "b")
        assert dist.set_timeout is dist.distributed_c10d._set_pg_timeout
        m = flex.create_block_mask(lambda b, h, q, k: q >= k, None, None, 128, 128,
                                   device="cpu", separate_full_blocks=True)
        assert m.shape[-2:] == (128, 128)
    """)  # fmt: skip
    assert len(applied) == 3, applied
