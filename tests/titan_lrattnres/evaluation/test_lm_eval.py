"""lm-evaluation-harness on the Hugging Face export: the shipped task
(``titan_lrattnres/evaluation/lm_eval_tasks``) run by the documented ``lm_eval --model hf``
command gives the project's own validation cross-entropy in bits per byte.

lm-eval's ``loglikelihood_rolling`` (``lm_eval.utils.get_rolling_token_windows`` with
``context_len=1``, then ``make_disjoint_window``): a document's tokens ``d`` are scored after the
prefix token (BOS = ``<|endoftext|>``) in disjoint chunks of ``L = max_length`` targets, each chunk
conditioned on the ``L`` tokens before its last target (no state carried between windows); the
document's log-likelihood is the sum over its tokens, and ``bits_per_byte = -sum(ll) / (sum of
UTF-8 bytes of the documents * ln 2)`` (``count_bytes``: ``len(text.encode("utf-8"))``)."""

import glob
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.tasks import TaskManager
from tokenizers import Tokenizer

from titan_lrattnres.components import data
from titan_lrattnres.evaluation.hf import export_hf
from titan_lrattnres.evaluation.hf.convert import model_max_len
from titan_lrattnres.evaluation.inference import build_model
from titan_lrattnres.evaluation.lm_eval_tasks import TASK, task_dir, validation_docs

ROOT = Path(__file__).resolve().parents[3]
DOCS = 4  # the first documents of the tiny corpus's validation split (~3.7k tokens at V=1024)
V = 1030  # > the tiny corpus tokenizer's 1024 ids, not a multiple of 64: padded head rows


def _trained():
    """A ``debug`` model (P-LR, 2 blocks) trained a few AdamW steps on random tokens."""
    torch.manual_seed(0)
    args = dict(flavor="debug", variant="projected", blocks=2, rank=16, vocab_size=V)
    model = build_model(args, depth_backend="reference").train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    batch = torch.randint(0, V, (4, 33))
    for _ in range(3):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _project_nll(model, ids: list[int], eot: int) -> float:
    """Summed cross-entropy (nats) of a document's tokens ``ids`` with the project's model, on
    ``[EOT] + ids`` as training sees a document; longer than the context ``L``: the targets in
    chunks of ``L``, each chunk after the ``L`` tokens before its last target."""
    seq = torch.tensor([eot, *ids])
    n, width = len(ids), model_max_len(model)
    total = 0.0
    for start in range(0, n, width):  # this chunk's targets are seq[start + 1 : end + 1]
        end = min(start + width, n)
        lo = max(0, end - width)
        with torch.no_grad():
            logits = model(seq[lo:end][None])[0].float()
        ce = F.cross_entropy(logits, seq[lo + 1 : end + 1], reduction="none")
        total += ce[start - lo :].sum().item()
    return total


def _val_texts(cache: Path) -> list[str]:
    with open(data.corpus_dir(cache) / "val.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_task_reads_the_validation_split_verbatim(env, monkeypatch):
    # shipped: the YAML is package data, so an installed package has it beside the loader
    assert (task_dir() / f"{TASK}.yaml").is_file()
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    section = lines[lines.index("[tool.setuptools.package-data]") + 1 :]
    entry = next(line for line in section if line.startswith("titan_lrattnres = ["))
    assert '"evaluation/lm_eval_tasks/*.yaml"' in entry.split("]")[0]
    monkeypatch.setenv(data.CACHE_ENV, env[data.CACHE_ENV])
    texts = _val_texts(Path(env[data.CACHE_ENV]))
    assert validation_docs()["test"]["text"] == texts
    manager = TaskManager(include_path=str(task_dir()), include_defaults=False)
    task = manager.load(TASK)["tasks"][TASK]
    assert task.OUTPUT_TYPE == "loglikelihood_rolling"
    assert [task.doc_to_target(d) for d in task.test_docs()] == texts
    # the target is the column, not a template: a document that looks like a Python literal
    # (templated targets of the form "[...]" are literal_eval'd by lm-eval) stays text
    odd = ["[1, 2]\n", "{{ x }}\n"]
    for text in odd:
        assert task.doc_to_target({"text": text}) == text


def test_lm_eval_bits_per_byte_equals_project_cross_entropy(env, tmp_path):
    cache = Path(env[data.CACHE_ENV])
    tokenizer = data.tokenizer_dir(cache) / "tokenizer.json"
    model = _trained()
    record = export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    eot = record["eos_token_id"]
    assert eot is not None

    # the documented command, run on the first DOCS documents (--limit); the task folder as the
    # docs find it
    include = subprocess.run(
        [sys.executable, "-m", "titan_lrattnres.evaluation.lm_eval_tasks"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    ).stdout.strip()
    assert Path(include) == task_dir()
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        "--device",
        "cpu",
        "--tasks",
        TASK,
        "--include_path",
        include,
        "--batch_size",
        "1",
        "--limit",
        str(DOCS),
        "--output_path",
        str(tmp_path / "out"),
    ]
    run_env = dict(env, HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    subprocess.run(cmd, check=True, env=run_env, cwd=tmp_path, timeout=600)
    (results,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    got = json.loads(Path(results).read_text())["results"][TASK]
    assert got["sample_len"] == DOCS

    tok = Tokenizer.from_file(str(tokenizer))
    assert tok.token_to_id(data.EOT) == eot
    texts = _val_texts(cache)[:DOCS]
    encoded = [tok.encode(t).ids for t in texts]
    # the rolling windows are exercised: some document is longer than the context
    assert max(len(ids) for ids in encoded) > model_max_len(model)
    nll = sum(_project_nll(model, ids, eot) for ids in encoded)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    want = nll / (n_bytes * math.log(2))
    assert got["bits_per_byte,none"] == pytest.approx(want, rel=1e-4)
    assert got["byte_perplexity,none"] == pytest.approx(2.0**want, rel=1e-3)
