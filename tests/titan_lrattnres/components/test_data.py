"""The embedded corpus: selection, split, determinism, clear errors, torchtitan loading."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from titan_lrattnres.components import data

_SRC = (
    "def f{i}(x):\n    '''Doc {i}.'''\n    return [x * {i} for _ in range({i})]\n\n"
    "class C{i}:\n    value = {i}\n"
)


def _files(tmp_path: Path, n: int = 80) -> list[tuple[str, Path]]:
    root = tmp_path / "src"
    root.mkdir()
    out = []
    for i in range(n):
        p = root / f"mod_{i:03d}.py"
        p.write_text(_SRC.format(i=i) * 3)
        out.append((p.name, p))
    return out


def test_stdlib_selection_is_portable_and_has_no_tests():
    files = data.stdlib_files()
    rels = [r for r, _ in files]
    assert len(rels) > 300 and rels == sorted(rels)
    for r in rels:
        parts = r.split("/")
        assert r.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts)
        assert not parts[-1].startswith("_sysconfigdata_")
        assert not parts[0].startswith("config-3.")
    assert "os.py" in rels and "json/decoder.py" in rels


def test_validation_split_is_path_hash_about_5_percent():
    rels = [r for r, _ in data.stdlib_files()]
    val = [r for r in rels if data.is_validation(r)]
    assert 0.02 < len(val) / len(rels) < 0.09
    assert data.is_validation("a/b.py") == data.is_validation("a/b.py")


def test_build_is_byte_identical_and_hashed(tmp_path):
    files = _files(tmp_path)
    m1 = data.build_corpus(tmp_path / "c1", files, vocab_size=300)
    m2 = data.build_corpus(tmp_path / "c2", files, vocab_size=300)
    assert m1 == m2
    for name in m1["files_sha256"]:
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()
    assert m1["python_version"] == platform.python_version()
    assert m1["train_files"] + m1["val_files"] == len(files)
    assert 0 < m1["unigram_entropy_train"] < m1["vocab_size"]
    # a different corpus changes the hash
    files[0][1].write_text("x = 1\n")
    m3 = data.build_corpus(tmp_path / "c3", files, vocab_size=300)
    assert m3["corpus_sha256"] != m1["corpus_sha256"]


def test_chunks_cover_each_file_in_hash_order():
    text = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(400))
    chunks = data.chunk_records(
        [{"path": "a.py", "text": text}, {"path": "b.py", "text": "y\n"}], size=500
    )
    keys = [c["path"] for c in chunks]
    assert keys == sorted(keys, key=lambda k: data.hashlib.sha256(k.encode()).hexdigest())
    a = sorted(
        (c for c in chunks if c["path"].startswith("a.py#")),
        key=lambda c: int(c["path"].split("#")[1]),
    )
    assert "".join(c["text"] for c in a) == text and len(a) > 10
    assert all(len(c["text"].encode()) < 500 + 60 for c in a)
    assert {"path": "b.py#0", "text": "y\n"} in chunks


def test_bad_files_skipped_with_count_or_named_in_strict_mode(tmp_path):
    files = _files(tmp_path, 4)
    bad = tmp_path / "src" / "latin1.py"
    bad.write_bytes(b"caf\xe9 = 1\n")
    empty = tmp_path / "src" / "empty.py"
    empty.write_text("  \n")
    all_files = files + [("latin1.py", bad), ("empty.py", empty)]
    docs = data.read_documents(all_files, strict=False)
    assert len(docs.records) == 4
    assert docs.skipped_non_utf8 == ["latin1.py"] and docs.skipped_empty == ["empty.py"]
    with pytest.raises(data.CorpusError, match="latin1.py: not UTF-8"):
        data.read_documents(all_files, strict=True)
    with pytest.raises(data.CorpusError, match="empty.py: empty"):
        data.read_documents(files + [("empty.py", empty)], strict=True)


def test_corpus_with_an_empty_split_is_refused(tmp_path):
    files = [f for f in _files(tmp_path) if not data.is_validation(f[0])]
    with pytest.raises(data.CorpusError, match="0 validation files"):
        data.build_corpus(tmp_path / "c", files, vocab_size=300)


def test_cache_from_another_python_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    m = data.build_corpus(data.corpus_dir(), _files(tmp_path), vocab_size=300)
    data.check_manifest(m)  # same interpreter: fine
    m["python_version"] = "3.99.0"
    (data.corpus_dir() / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(data.CorpusError, match=r"built from Python 3\.99\.0.*this is Python"):
        data.ensure_built(quiet=True)


def test_tokenizer_works_with_torchtitan(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    data.build_corpus(tmp_path / "c", _files(tmp_path), vocab_size=300)
    tok = HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "c" / "tokenizer"))
    eot = tok.tokenizer.token_to_id(data.EOT)
    assert tok.bos_id == tok.eos_id == eot == 0
    ids = tok.encode("def f(x):\n    return x\n", add_bos=True, add_eos=True)
    assert ids[0] == eot and ids[-1] == eot and eot not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == "def f(x):\n    return x\n"


def test_registered_datasets_load(tmp_path, monkeypatch):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    files = _files(tmp_path)
    data.build_corpus(data.corpus_dir(), files, vocab_size=300)
    data.register_datasets()
    for name in data.DATASET_NAMES:
        assert name in DATASETS
    cfg = DATASETS["stdlib_py_val"]
    val = cfg.loader(cfg.path)
    assert len(val) == sum(data.is_validation(r) for r, _ in files)
    own = DATASETS["text_files"].loader(str(tmp_path / "src"))
    assert len(own) == len(files) and own[0]["text"] == files[0][1].read_text()
    with pytest.raises(data.CorpusError, match="no files found"):
        DATASETS["text_files"].loader(str(tmp_path / "nothing-here"))


def test_ensure_built_builds_when_missing_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    files = _files(tmp_path)
    monkeypatch.setattr(data, "stdlib_files", lambda: files)
    manifest_path = data.corpus_dir() / "manifest.json"
    assert not manifest_path.exists()
    m1 = data.ensure_built(quiet=True)
    stamp = manifest_path.stat().st_mtime_ns
    assert data.ensure_built(quiet=True) == m1 and manifest_path.stat().st_mtime_ns == stamp
    old = dict(m1, format_version=data.FORMAT_VERSION - 1)
    manifest_path.write_text(json.dumps(old))
    assert data.ensure_built(quiet=True) == m1  # an older format is rebuilt, same bytes
