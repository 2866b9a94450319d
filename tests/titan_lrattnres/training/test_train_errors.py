"""Bad input to the entry point: one clear line on stderr, exit code 1, nothing trained."""

from __future__ import annotations

import pytest

from titan_lrattnres import train
from titan_lrattnres.components import data


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    files = []
    for i in range(60):
        p = tmp_path / "src" / f"m{i:02d}.py"
        p.parent.mkdir(exist_ok=True)
        p.write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
        files.append((p.name, p))
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    data.build_corpus(data.corpus_dir(), files, vocab_size=300)
    return tmp_path


def _main(capsys, *args) -> str:
    assert train.main(["cpu_smoke", "--dump_folder", "/nonexistent/never-written", *args]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_unknown_dataset_lists_registered_ones(tiny_cache, capsys):
    err = _main(capsys, "--dataloader.dataset", "c5_typo")
    assert "--dataloader.dataset 'c5_typo' is not a registered dataset" in err
    assert "stdlib_py" in err and "text_files" in err


def test_unknown_validation_dataset(tiny_cache, capsys):
    err = _main(capsys, "--validator.dataloader.dataset", "nope_val")
    assert "--validator.dataloader.dataset 'nope_val'" in err


def test_missing_tokenizer_says_how_to_make_one(tiny_cache, capsys):
    err = _main(capsys, "--hf_assets_path", str(tiny_cache / "no_tokenizer"))
    assert "no tokenizer at" in err and "titan_lrattnres.data build" in err


def test_corpus_smaller_than_one_batch(tiny_cache, capsys):
    err = _main(capsys, "--training.seq_len", "4096", "--training.local_batch_size", "64")
    assert "fewer than one batch" in err and "262,144" in err


def test_own_corpus_with_bad_file_names_it(tiny_cache, capsys):
    own = tiny_cache / "own"
    own.mkdir()
    (own / "good.txt").write_text("hello world\n" * 500)
    (own / "bad.txt").write_bytes(b"\xff\xfe broken")
    err = _main(capsys, "--dataloader.dataset", "text_files", "--dataloader.dataset_path", str(own))
    assert "bad.txt: not UTF-8" in err


def test_own_corpus_too_small(tiny_cache, capsys):
    own = tiny_cache / "own"
    own.mkdir()
    (own / "a.txt").write_text("tiny\n")
    err = _main(capsys, "--dataloader.dataset", "text_files", "--dataloader.dataset_path", str(own))
    assert f"corpus {own} has" in err and "fewer than one batch" in err


def test_paper_config_without_a_dataset_path(tiny_cache, capsys):
    assert train.main(["paper_baseline"]) == 1
    err = capsys.readouterr().err
    assert "--dataloader.dataset 'hf_text' reads your own data" in err
    assert "--dataloader.dataset_path" in err
