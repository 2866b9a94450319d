"""The benchmarks' one metadata helper (``benchmarks.meta``): the machine, software, code and
date every result JSON carries, and a copied tree without git still writes one."""

from __future__ import annotations

import datetime
import json
import re

import torch

from benchmarks import meta, pipeline_hops

KEYS = {"python", "torch", "machine", "cpu", "threads", "code", "date"}


def test_environment_keys():
    env = meta.environment("cpu")
    assert set(env) == KEYS  # "gpu" only for a CUDA device
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert env["code"] is None or re.fullmatch(r"[0-9a-f]{7}(-dirty)?", env["code"]), env["code"]
    assert datetime.datetime.fromisoformat(env["date"]).tzinfo is not None
    assert set(meta.environment()) == KEYS


def test_no_checkout_no_code(tmp_path, monkeypatch):
    monkeypatch.setattr(meta, "ROOT", tmp_path)
    assert meta.code() is None


def test_a_benchmark_json_carries_it(tmp_path):
    out = tmp_path / "hops.json"
    args = ["--layers", "16", "--dim", "8", "--blocks", "2", "--rank", "4", "--json", str(out)]
    assert pipeline_hops.main(args) == 0
    written = json.loads(out.read_text())
    assert KEYS <= set(written) and written["args"]["layers"] == 16 and written["tables"]
