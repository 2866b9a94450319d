"""lm-evaluation-harness tasks on the embedded corpus (``lrattnres_stdlib_val.yaml``).

``lrattnres_stdlib_val``: the held-out split of the embedded stdlib corpus (``val.jsonl`` under
``$LRATTNRES_DATA_DIR``, built on first use like the training data), each document scored whole
with rolling log-likelihood (``loglikelihood_rolling``): ``bits_per_byte``, ``byte_perplexity``
and ``word_perplexity``. Offline: the documents come from :func:`validation_docs`, not the Hub.

``python -m titan_lrattnres.evaluation.lm_eval_tasks`` prints this folder, for
``lm_eval --include_path``. ``--metadata '{"val_jsonl": "FILE"}'`` scores another ``{"text":
...}`` JSONL file instead."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "lrattnres_stdlib_val"


def task_dir() -> Path:
    """The folder to give ``lm_eval --include_path``."""
    return Path(__file__).resolve().parent


def validation_jsonl() -> Path:
    """The embedded corpus's held-out split, building the corpus first if it is missing."""
    from titan_lrattnres.components.data import CorpusError, corpus_dir, ensure_built

    ensure_built()
    path = corpus_dir() / "val.jsonl"
    if not path.is_file():
        raise CorpusError(f"{path} does not exist; run `python -m titan_lrattnres.data build`")
    return path


def validation_docs(val_jsonl: str | None = None, **metadata):
    """``custom_dataset`` of the task: ``DatasetDict(test=...)`` with a ``text`` column, in the
    file's order (``lm_eval --limit N`` scores the first N). ``metadata``: lm-eval passes the
    task's metadata and the model arguments; they are not used."""
    from datasets import Dataset, DatasetDict

    path = Path(val_jsonl) if val_jsonl else validation_jsonl()
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return DatasetDict(test=Dataset.from_dict({"text": texts}))
