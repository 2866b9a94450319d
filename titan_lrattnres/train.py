"""Entry point: ``python -m titan_lrattnres.train NAME [torchtitan CLI overrides...]``.

Equivalent to ``torchrun ... -m torchtitan.train --module titan_lrattnres --config NAME ...``
(it also works under torchrun), plus: the CPU patches are installed before torchtitan is
imported, the embedded corpus and tokenizer are built when missing, and bad inputs (an unknown
config or dataset, a missing tokenizer, a corpus shorter than one sequence, a checkpoint from
another model, a damaged or unsafe checkpoint, a NaN loss, a disk that is full or read-only) stop
with one clear line instead of a traceback. A preempted run (SIGTERM, ``--preemption.signal``)
saves its step and exits with ``preemption.EXIT_CODE`` (75).
"""

from __future__ import annotations

import os
import socket
import sys

from titan_lrattnres.training import cpu

USAGE = "usage: python -m titan_lrattnres.train NAME [--section.field VALUE ...]"


class UsageError(RuntimeError):
    pass


def _single_process_env() -> None:
    """Let a plain ``python`` launch act as a 1-rank torchrun job."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def parse(name: str, overrides: list[str]):
    """The ``Trainer.Config`` of experiment ``name`` with CLI ``overrides`` applied."""
    from train_configs import CONFIGS

    if name not in CONFIGS:
        raise UsageError(f"unknown config {name!r}. Available: {', '.join(sorted(CONFIGS))}")
    from torchtitan.config import ConfigManager

    default = CONFIGS[name]()
    if default.dataloader.dataset.startswith("stdlib_py") and "--hf_assets_path" not in overrides:
        # the embedded corpus's tokenizer is the default assets path: build it before
        # torchtitan checks that the path exists (preflight checks the data itself)
        from titan_lrattnres.components import data

        if not os.path.isdir(default.hf_assets_path):
            data.ensure_built()
    return ConfigManager().parse_args(["--module", "titan_lrattnres", "--config", name, *overrides])


def _min_tokens(config) -> int:
    """Tokens one batch needs on every data-parallel rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return config.training.seq_len * config.training.local_batch_size * world


def preflight(config) -> None:
    """Check data, tokenizer and sizes before the Trainer spends a minute building things."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from titan_lrattnres.components import data

    data.register_datasets()
    if config.checkpoint.create_seed_checkpoint and not config.checkpoint.enable:
        raise UsageError("--checkpoint.create_seed_checkpoint needs --checkpoint.enable")
    if config.checkpoint.create_seed_checkpoint and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("create the seed checkpoint in one process (it must not be sharded)")
    from titan_lrattnres.components import preemption

    try:
        preemption.signals_of(config.preemption)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.preemption.grace_seconds <= 0:
        raise UsageError("--preemption.grace_seconds must be positive")
    loaders = [("--dataloader.dataset", config.dataloader)]
    if config.validator.enable:
        loaders.append(("--validator.dataloader.dataset", config.validator.dataloader))
    for flag, dl in loaders:
        name = getattr(dl, "dataset", None)
        if name is not None and name.lower() not in DATASETS:
            raise data.CorpusError(
                f"{flag} {name!r} is not a registered dataset. Registered: "
                f"{', '.join(sorted(DATASETS))}"
            )
    for flag, dl in loaders:
        if getattr(dl, "dataset", "") in ("text_files", "hf_text", "hf_text_val") and not (
            dl.dataset_path
        ):
            raise data.CorpusError(
                f"{flag} {dl.dataset!r} reads your own data: also pass "
                f"{flag.removesuffix('dataset')}dataset_path (a directory, glob or HF dataset)"
            )
    stdlib = [
        dl
        for _, dl in loaders
        if getattr(dl, "dataset", "").startswith("stdlib_py") and not dl.dataset_path
    ]
    if stdlib:
        manifest = data.ensure_built()
        print(data.describe(manifest), flush=True)
        need = _min_tokens(config)
        for split in ("train", "val"):
            if manifest[f"{split}_tokens"] < need:
                raise data.CorpusError(
                    f"the {split} split has {manifest[f'{split}_tokens']:,} tokens, fewer than "
                    f"one batch of seq_len x local_batch_size x ranks = {need:,}"
                )
    for _, dl in loaders:
        if getattr(dl, "dataset", "") == "text_files" and dl.dataset_path:
            _check_text_files(dl.dataset_path, config)
    tok_json = os.path.join(config.hf_assets_path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        raise data.CorpusError(
            f"no tokenizer at {config.hf_assets_path} (tokenizer.json missing). For the stdlib "
            "corpus: python -m titan_lrattnres.data build; for your own text: python -m "
            "titan_lrattnres.data tokenizer SRC OUT, then --hf_assets_path OUT"
        )
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tok_json).get_vocab_size()
    model_vocab = config.model_spec.model.vocab_size
    if vocab > model_vocab:
        raise data.CorpusError(
            f"tokenizer at {config.hf_assets_path} has {vocab} tokens but the model's "
            f"vocabulary is {model_vocab}; use a smaller tokenizer or another flavor"
        )


def _check_text_files(path: str, config) -> None:
    from tokenizers import Tokenizer

    from titan_lrattnres.components import data

    tok = Tokenizer.from_file(os.path.join(config.hf_assets_path, "tokenizer.json"))
    need, total = _min_tokens(config), 0
    for _, p in data.text_file_paths(path):
        docs = data.read_documents([(str(p), p)], strict=True)
        total += len(tok.encode(docs.records[0]["text"]).ids) + 2
        if total >= need:
            return
    raise data.CorpusError(
        f"corpus {path} has {total:,} tokens, fewer than one batch of seq_len x "
        f"local_batch_size x ranks = {need:,}"
    )


def finished_step(config) -> int:
    """The step of the newest checkpoint at or past ``training.steps`` that passes verification
    (``titan_lrattnres.components.integrity``), else -1: a damaged or interrupted final checkpoint
    is no finished run (training resumes from the newest intact one instead)."""
    from titan_lrattnres.components import integrity

    if not config.checkpoint.enable:
        return -1
    folder = os.path.join(config.dump_folder, config.checkpoint.folder)
    for step, path in integrity.step_folders(folder):
        if step >= config.training.steps and integrity.problem(path) is None:
            return step
    return -1


def run(config) -> None:
    """Build the Trainer and train (torchtitan.train.main, minus its argument parsing)."""
    import torch
    from torchtitan.observability import structured_logger as sl

    sl.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            trainer.save_seed_checkpoint()
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _report(config) -> None:
    """One closing line on rank 0: the validation loss against the corpus's unigram entropy."""
    import json

    path = os.path.join(config.dump_folder, "summary.json")
    if os.environ.get("RANK", "0") != "0" or not os.path.isfile(path):
        return
    with open(path) as f:
        s = json.load(f)
    val, uni = s.get("final_val_loss"), s.get("unigram_entropy")
    line = f"done: {s.get('steps')} steps, {s.get('tokens', 0):,} tokens"
    if val is not None:
        line += f", validation loss {val:.4f}"
    if uni is not None:
        line += f" (unigram entropy of the corpus {uni:.4f})"
    print(f"{line}; {path}, {os.path.join(config.dump_folder, 'loss.png')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("-"):
        from train_configs import CONFIGS

        print(USAGE + "\nconfigs: " + ", ".join(sorted(CONFIGS)))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cpu.apply()  # before torchtitan is imported
    from torchtitan.tools.logging import init_logger

    from titan_lrattnres.components.checkpoint import NonFiniteLossError
    from titan_lrattnres.components.convert import OldLayoutError
    from titan_lrattnres.components.data import CorpusError
    from titan_lrattnres.components.faults import WriteFaultError
    from titan_lrattnres.components.integrity import CheckpointIntegrityError
    from titan_lrattnres.components.preemption import Preempted
    from titan_lrattnres.training.trainer import CheckpointMismatchError

    init_logger()
    try:
        config = parse(argv[0], argv[1:])
        preflight(config)
        done = finished_step(config)
        if done >= config.training.steps:
            print(
                f"{config.dump_folder} already holds a finished run (checkpoint at step "
                f"{done} >= {config.training.steps} steps); see "
                f"{os.path.join(config.dump_folder, 'summary.json')}. To train again, delete "
                "the folder or pass --dump_folder NEW.",
                flush=True,
            )
            return 0
        _single_process_env()
        run(config)
        _report(config)
    except Preempted as e:  # its line is in the log already
        return e.code
    except (
        UsageError,
        CorpusError,
        CheckpointMismatchError,
        CheckpointIntegrityError,
        NonFiniteLossError,
        OldLayoutError,
        WriteFaultError,
    ) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
