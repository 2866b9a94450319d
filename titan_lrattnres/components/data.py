"""The embedded offline corpus (Python stdlib sources), its tokenizer, and dataset registration.

``python -m titan_lrattnres.data build [--force]`` writes, under ``$LRATTNRES_DATA_DIR``
(default ``data_cache/`` in the repository root)::

    stdlib_py/train.jsonl, val.jsonl    {"path": "file.py#k", "text": chunk k of the file}
    stdlib_py/tokenizer/                byte-level BPE, V=4096, <|endoftext|> = BOS = EOS
    stdlib_py/manifest.json             Python version, counts, hashes, unigram entropy

Corpus: the portable, no-tests ``.py`` files of the running interpreter's stdlib (no
site-packages, __pycache__, test/tests/idle_test dirs, ``_sysconfigdata_*``, ``config-3.*``).
A file is validation iff ``int(sha256(relative path)[:8], 16) % 100 < 5``. Files are cut at line
boundaries into ~2 KB chunks stored in sha256(path#k) order: the loader packs documents in order,
so whole files would feed a short run hundreds of consecutive sequences of one module (a 750 KB
prose file, a codec table), and its loss would follow whichever file it is in.
Rebuilding gives byte-identical files; the manifest records their hashes.

Registered torchtitan datasets (``--dataloader.dataset NAME [--dataloader.dataset_path P]``):
``stdlib_py`` / ``stdlib_py_val`` (built on first use), ``text_files`` (P = a directory or glob
of UTF-8 text files, one document each) and ``hf_text`` (P = a HF dataset name or data dir with
a ``text`` column, split ``train``; ``hf_text_val`` reads split ``validation``).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
VAL_PERCENT = 5
CHUNK_BYTES = 2048
FORMAT_VERSION = 2
CACHE_ENV = "LRATTNRES_DATA_DIR"
_PLACEHOLDER = f"${CACHE_ENV}/stdlib_py"
_SKIP_DIRS = {"site-packages", "__pycache__", "test", "tests", "idle_test"}


class CorpusError(RuntimeError):
    """A corpus or tokenizer problem the user can fix; the message says how."""


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data_cache"


def corpus_dir(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "stdlib_py"


def tokenizer_dir(cache: Path | None = None) -> Path:
    return corpus_dir(cache) / "tokenizer"


def is_validation(rel_path: str) -> bool:
    return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of the portable, no-tests stdlib ``.py`` files."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-3.")
        )
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata_"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


@dataclass
class Documents:
    records: list[dict[str, str]]  # {"path", "text"}
    skipped_empty: list[str]
    skipped_non_utf8: list[str]


def read_documents(files: Iterable[tuple[str, Path]], *, strict: bool) -> Documents:
    """Read each file as one UTF-8 document. ``strict`` (a user's corpus): an empty or
    non-UTF-8 file is an error naming it; otherwise it is skipped and counted."""
    docs = Documents([], [], [])
    for rel, path in files:
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise CorpusError(f"{path}: not UTF-8 ({e}); convert or remove it") from e
            docs.skipped_non_utf8.append(rel)
            continue
        if not text.strip():
            if strict:
                raise CorpusError(f"{path}: empty file; remove it from the corpus")
            docs.skipped_empty.append(rel)
            continue
        docs.records.append({"path": rel, "text": text})
    return docs


def chunk_records(records: list[dict[str, str]], size: int = CHUNK_BYTES) -> list[dict[str, str]]:
    """Cut each document at line boundaries into pieces of about ``size`` bytes, ordered by
    sha256 of ``path#k`` (a fixed shuffle)."""
    out = []
    for r in records:
        piece, n, k = [], 0, 0
        for line in r["text"].splitlines(keepends=True):
            piece.append(line)
            n += len(line.encode())
            if n >= size:
                out.append({"path": f"{r['path']}#{k}", "text": "".join(piece)})
                piece, n, k = [], 0, k + 1
        if piece and "".join(piece).strip():
            out.append({"path": f"{r['path']}#{k}", "text": "".join(piece)})
    out.sort(key=lambda r: hashlib.sha256(r["path"].encode()).hexdigest())
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def unigram_stats(tok, train: list[str], val: list[str]) -> dict[str, float | int]:
    """Entropy of the train token stream and the add-one-smoothed unigram CE on validation,
    in nats per token: the loss of a model that ignores context."""
    counts: Counter[int] = Counter()
    for enc in tok.encode_batch(train):
        counts.update(enc.ids)
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    v = tok.get_vocab_size()
    val_n, val_nll = 0, 0.0
    for enc in tok.encode_batch(val):
        for i in enc.ids:
            val_nll -= math.log((counts.get(i, 0) + 1) / (n + v))
        val_n += len(enc.ids)
    return {
        "train_tokens": n,
        "val_tokens": val_n,
        "unigram_entropy_train": entropy,
        "unigram_ce_val": val_nll / max(val_n, 1),
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_jsonl(records: list[dict[str, str]], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def build_corpus(
    out: Path,
    files: list[tuple[str, Path]],
    *,
    vocab_size: int = VOCAB_SIZE,
    strict: bool = False,
    source: str = "stdlib",
) -> dict:
    """Write train/val JSONL, the tokenizer and the manifest into ``out`` (replaced)."""
    docs = read_documents(files, strict=strict)
    train = [r for r in docs.records if not is_validation(r["path"])]
    val = [r for r in docs.records if is_validation(r["path"])]
    if not train or not val:
        raise CorpusError(
            f"corpus from {source} has {len(train)} train and {len(val)} validation files; "
            "both splits need at least one non-empty UTF-8 file"
        )
    corpus_hash = hashlib.sha256()
    for r in sorted(docs.records, key=lambda r: r["path"]):
        corpus_hash.update(r["path"].encode() + b"\0" + r["text"].encode() + b"\0")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        n_train_files, n_val_files = len(train), len(val)
        train, val = chunk_records(train), chunk_records(val)
        _write_jsonl(train, tmp / "train.jsonl")
        _write_jsonl(val, tmp / "val.jsonl")
        tok = train_tokenizer((r["text"] for r in train), vocab_size)
        save_tokenizer(tok, tmp / "tokenizer")
        stats = unigram_stats(tok, [r["text"] for r in train], [r["text"] for r in val])
        manifest = {
            "format_version": FORMAT_VERSION,
            "source": source,
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "vocab_size": tok.get_vocab_size(),
            "train_files": n_train_files,
            "val_files": n_val_files,
            "train_chunks": len(train),
            "val_chunks": len(val),
            "train_bytes": sum(len(r["text"].encode()) for r in train),
            "val_bytes": sum(len(r["text"].encode()) for r in val),
            "skipped_empty": len(docs.skipped_empty),
            "skipped_non_utf8": len(docs.skipped_non_utf8),
            **stats,
            "corpus_sha256": corpus_hash.hexdigest(),
            "files_sha256": {
                name: _sha256(tmp / name)
                for name in (
                    "train.jsonl",
                    "val.jsonl",
                    "tokenizer/tokenizer.json",
                    "tokenizer/tokenizer_config.json",
                )
            },
        }
        manifest["content_hash"] = hashlib.sha256(
            json.dumps(manifest["files_sha256"], sort_keys=True).encode()
        ).hexdigest()[:16]
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


@contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # concurrent ranks: one builds, the others wait
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_manifest(cache: Path | None = None) -> dict | None:
    path = corpus_dir(cache) / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def check_manifest(manifest: dict, cache: Path | None = None) -> None:
    here = platform.python_version()
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorpusError(
            f"{corpus_dir(cache)} has format {manifest.get('format_version')}, this code expects "
            f"{FORMAT_VERSION}; rebuild: python -m titan_lrattnres.data build --force"
        )
    if manifest["python_version"] != here:
        raise CorpusError(
            f"the cached corpus in {corpus_dir(cache)} was built from Python "
            f"{manifest['python_version']}'s stdlib, but this is Python {here}: its stdlib "
            "differs, so losses would not be comparable. Rebuild it with "
            "`python -m titan_lrattnres.data build --force`, or point "
            f"{CACHE_ENV} at a cache built by Python {manifest['python_version']}."
        )


def ensure_built(cache: Path | None = None, *, force: bool = False, quiet: bool = False) -> dict:
    """The manifest of the stdlib corpus, building it first if missing (or ``force``)."""
    out = corpus_dir(cache)
    with _lock(out.parent / ".stdlib_py.lock"):
        manifest = None if force else load_manifest(cache)
        if manifest is not None and manifest.get("format_version") != FORMAT_VERSION:
            manifest = None  # written by an older version of this code: rebuild
        if manifest is None:
            if not quiet:
                print(f"[data] building the stdlib corpus and tokenizer into {out} ...", flush=True)
            manifest = build_corpus(out, stdlib_files())
    check_manifest(manifest, cache)
    return manifest


def describe(m: dict) -> str:
    return (
        f"[data] stdlib_py (Python {m['python_version']}): {m['train_files']} train / "
        f"{m['val_files']} val files, {m['train_tokens']:,} / {m['val_tokens']:,} tokens at "
        f"V={m['vocab_size']}; unigram entropy {m['unigram_entropy_train']:.3f} nats/token "
        f"(val unigram CE {m['unigram_ce_val']:.3f}); skipped {m['skipped_empty']} empty, "
        f"{m['skipped_non_utf8']} non-UTF-8; content hash {m['content_hash']}"
    )


# --- torchtitan registration -------------------------------------------------------------


def _resolve(path: str | None) -> Path:
    if not path or path == _PLACEHOLDER:
        ensure_built()
        return corpus_dir()
    return Path(path)


def _load_jsonl(path: str | None, split: str):
    from datasets import load_dataset

    d = _resolve(path)
    f = d / f"{split}.jsonl"
    if not f.exists():
        raise CorpusError(f"{f} does not exist; run `python -m titan_lrattnres.data build`")
    return load_dataset("json", data_files=str(f), split="train", cache_dir=str(d / "hf_cache"))


def text_file_paths(path: str) -> list[tuple[str, Path]]:
    p = Path(path)
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        base = p
    else:
        files = sorted(Path(q) for q in glob.glob(path, recursive=True) if Path(q).is_file())
        base = Path(os.path.commonpath([str(q.parent) for q in files])) if files else p
    if not files:
        raise CorpusError(f"text_files dataset: no files found at {path!r}")
    return [(q.relative_to(base).as_posix(), q) for q in files]


def _load_text_files(path: str | None):
    from datasets import Dataset

    if not path:
        raise CorpusError("dataset text_files needs --dataloader.dataset_path DIR_OR_GLOB")
    docs = read_documents(text_file_paths(path), strict=True)
    return Dataset.from_list(docs.records)


def _load_hf(path: str | None, split: str):
    from datasets import load_dataset

    if not path:
        raise CorpusError("dataset hf_text needs --dataloader.dataset_path NAME_OR_DIR")
    return load_dataset(path, split=split)


def _text(sample) -> str:
    return sample["text"]


DATASET_NAMES = ("stdlib_py", "stdlib_py_val", "text_files", "hf_text", "hf_text_val")


def register_datasets() -> None:
    """Add our datasets to torchtitan's registry (idempotent)."""
    from functools import partial

    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS["stdlib_py"] = DatasetConfig(_PLACEHOLDER, partial(_load_jsonl, split="train"), _text)
    DATASETS["stdlib_py_val"] = DatasetConfig(
        _PLACEHOLDER, partial(_load_jsonl, split="val"), _text
    )
    DATASETS["text_files"] = DatasetConfig("", _load_text_files, _text)
    DATASETS["hf_text"] = DatasetConfig("", partial(_load_hf, split="train"), _text)
    DATASETS["hf_text_val"] = DatasetConfig("", partial(_load_hf, split="validation"), _text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the stdlib corpus + tokenizer (cached)")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    t = sub.add_parser("tokenizer", help="train a tokenizer on your own text files")
    t.add_argument("source", help="directory or glob of UTF-8 text files")
    t.add_argument("out", help="output directory (use as --hf_assets_path)")
    t.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    sub.add_parser("info", help="print the cached corpus manifest")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            m = ensure_built(force=args.force, quiet=True)
            print(describe(m))
            print(f"[data] {corpus_dir()}")
        elif args.cmd == "tokenizer":
            docs = read_documents(text_file_paths(args.source), strict=True)
            tok = train_tokenizer((r["text"] for r in docs.records), args.vocab_size)
            save_tokenizer(tok, Path(args.out))
            print(f"[data] tokenizer with V={tok.get_vocab_size()} written to {args.out}")
        else:
            m = load_manifest()
            if m is None:
                print(f"no corpus at {corpus_dir()}; run: python -m titan_lrattnres.data build")
                return 1
            print(json.dumps(m, indent=2, sort_keys=True))
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
