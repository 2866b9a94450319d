"""Run summary: ``summary.json`` and ``loss.png`` in the run folder (``--dump_folder``)."""

from __future__ import annotations

import json
import os
import resource
import time

from titan_lrattnres.model.registry import ModelIdentity


def _corpus_stats(dataset: str) -> dict:
    if not dataset.startswith("stdlib_py"):
        return {}
    from titan_lrattnres.components.data import load_manifest

    m = load_manifest()
    if not m:
        return {}
    return {
        "corpus": "stdlib_py",
        "corpus_content_hash": m["content_hash"],
        "python_version": m["python_version"],
        "unigram_entropy": m["unigram_entropy_train"],
        "unigram_ce_val": m["unigram_ce_val"],
    }


def build_summary(trainer) -> dict:
    cfg = trainer.config
    spec = cfg.model_spec
    router = spec.model.router
    hist, val = trainer.history, trainer.val_history
    wall = time.perf_counter() - trainer.metrics_processor.t0
    train_t0 = trainer.metrics_processor.train_t0  # at the first logged step
    train_wall = (time.perf_counter() - train_t0) if train_t0 else None
    # Training throughput spans the logged steps only: from the first step's log (its compile
    # excluded) to the last one's, without the validations and saves between them (train_s,
    # RunMetricsProcessor.paused); the _wall figure keeps them all in.
    steps_wall = hist[-1]["train_s"] - hist[0]["train_s"] if len(hist) > 1 else None
    tokens = hist[-1]["tokens"] if hist else trainer.ntokens_seen
    first_tokens = hist[0]["tokens"] if hist else 0
    tail = [h["loss"] for h in hist[-10:]]
    return {
        "config": getattr(cfg, "run_name", ""),
        **ModelIdentity.of(spec.model, spec.flavor).record(),
        "depth_backend": router.backend,
        "steps": trainer.step,
        "tokens": tokens,
        "seq_len": cfg.training.seq_len,
        "local_batch_size": cfg.training.local_batch_size,
        "final_train_loss": hist[-1]["loss"] if hist else None,
        "final_train_loss_mean_last10": sum(tail) / len(tail) if tail else None,
        "final_val_loss": val[-1]["loss"] if val else None,
        "val_history": val,
        **_corpus_stats(cfg.dataloader.dataset),
        "tokens_per_s": (tokens - first_tokens) / steps_wall if steps_wall else None,
        "tokens_per_s_wall": (tokens - first_tokens) / train_wall if train_wall else None,
        "wall_time_s": wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "compile": cfg.compile.enable,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }


def plot_loss(trainer, path: str, title: str, unigram_entropy: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if trainer.history:
        ax.plot(
            [h["step"] for h in trainer.history],
            [h["loss"] for h in trainer.history],
            label="train",
            lw=1,
        )
    if trainer.val_history:
        ax.plot(
            [v["step"] for v in trainer.val_history],
            [v["loss"] for v in trainer.val_history],
            "o",
            label="validation",
        )
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, ls="--", c="gray", lw=1, label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_summary(trainer, last_checkpoint: str | None = None) -> dict:
    """``summary.json``, ``loss_history.json`` and ``loss.png``; a write that fails for want of
    space or permission raises ``WriteFaultError`` in one line naming ``last_checkpoint``."""
    from titan_lrattnres.components.faults import writing

    folder = trainer.config.dump_folder
    summary = build_summary(trainer)
    paths = {k: os.path.join(folder, k) for k in ("summary.json", "loss_history.json", "loss.png")}
    with writing("the run folder", folder, last_checkpoint, resume=False):
        os.makedirs(folder, exist_ok=True)
    with writing("the run summary", paths["summary.json"], last_checkpoint, resume=False):
        with open(paths["summary.json"], "w") as f:
            json.dump(summary, f, indent=2)
    with writing("the loss history", paths["loss_history.json"], last_checkpoint, resume=False):
        with open(paths["loss_history.json"], "w") as f:
            json.dump(trainer.history, f)
    title = f"{summary['config'] or summary['flavor']} ({summary['variant']})"
    with writing("the loss plot", paths["loss.png"], last_checkpoint, resume=False):
        plot_loss(trainer, paths["loss.png"], title, summary.get("unigram_entropy"))
    return summary
