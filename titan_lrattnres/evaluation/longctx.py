"""Long inputs: loss by position at 1x, 2x and 4x the training length, and a copy probe.

    python -m titan_lrattnres.longctx --runs RUN [RUN ...] --out DIR [--train-len 256]
        [--factors 1,2,4] [--tokens 65536] [--span 48] [--gaps 0,128,384,896] [--probes 32]

- **Loss by position.** The held-out split (the embedded corpus's ``val.jsonl`` unless
  ``--val-jsonl``) cut into non-overlapping sequences of ``factor x train_len`` tokens; the mean
  next-token loss per position, in buckets of ``train_len / 4`` positions. Beyond the training
  length the model extrapolates (RoPE positions it never trained on).
- **Copy probe** (a task whose answer is known): the first ``span`` tokens of a held-out function
  (``def ...``), then ``gap`` tokens of other held-out text, then the same ``span`` tokens again.
  The loss on the second occurrence (its tokens after the first) against the first occurrence's:
  a model that can look back ``gap + span`` tokens copies, so its second loss drops towards 0.

Deterministic (seeded choice of functions and filler, eval mode, no sampling). Writes
``longctx.json``, ``loss_by_position.png`` and ``copy_probe.png`` into ``--out``; every run is
compared with the baseline run when one is given (``variant == "baseline"``).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.no_grad()
def position_losses(model, flat: torch.Tensor, length: int, max_seqs: int, batch: int = 4):
    """Mean next-token loss per position ``[length]`` over up to ``max_seqs`` sequences of
    ``length + 1`` consecutive tokens of ``flat``, and the number of sequences used."""
    n = min(max_seqs, (flat.numel() - 1) // (length + 1))
    if n < 1:
        raise ValueError(f"{flat.numel()} tokens hold no sequence of {length + 1}")
    seqs = flat[: n * (length + 1)].view(n, length + 1)
    total = torch.zeros(length, dtype=torch.float64)
    for i in range(0, n, batch):
        x = seqs[i : i + batch]
        logits = model(x[:, :-1]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        total += ce.view(x.shape[0], length).double().sum(0)
    return (total / n).tolist(), n


def buckets(losses: list[float], width: int) -> list[float]:
    """Means over consecutive buckets of ``width`` positions (the last may be shorter)."""
    return [sum(c) / len(c) for c in (losses[i : i + width] for i in range(0, len(losses), width))]


def function_spans(texts: list[str], encode, span: int) -> list[list[int]]:
    """The first ``span`` token ids of every top-level or method ``def`` in ``texts`` that has at
    least ``span`` tokens, in document order (functions parsed with ``ast``; unparsable
    documents are skipped)."""
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                src = ast.get_source_segment(text, node)
                ids = encode(src) if src else []
                if len(ids) >= span:
                    out.append(ids[:span])
    return out


def copy_sequence(span: list[int], filler: list[int]) -> tuple[torch.Tensor, slice, slice]:
    """``span + filler + span`` and the slices of the TARGET positions scored for the first and
    the second occurrence: the predictions of span tokens 1.. from the tokens before them."""
    n, g = len(span), len(filler)
    tokens = torch.tensor(span + filler + span, dtype=torch.long)
    # logits at position p predict token p + 1: span token i of an occurrence starting at s is
    # predicted at position s + i - 1
    return tokens, slice(0, n - 1), slice(n + g, 2 * n + g - 1)


@torch.no_grad()
def copy_probe(model, spans, filler_source: torch.Tensor, gaps, seed: int = 0) -> dict:
    """Per gap: mean loss on the first and on the second occurrence over ``spans``; the filler
    of each probe is a seeded slice of ``filler_source`` (held-out text)."""
    rng = random.Random(seed)
    result = {}
    for gap in gaps:
        first, second = [], []
        for span in spans:
            start = rng.randrange(0, max(1, filler_source.numel() - gap))
            filler = filler_source[start : start + gap].tolist()
            tokens, s1, s2 = copy_sequence(span, filler)
            logits = model(tokens[None, :-1]).float()[0]
            ce = F.cross_entropy(logits, tokens[1:], reduction="none")
            first.append(ce[s1].mean().item())
            second.append(ce[s2].mean().item())
        result[gap] = {
            "first_loss": sum(first) / len(first),
            "second_loss": sum(second) / len(second),
            "probes": len(spans),
        }
    return result


def _label(args: dict) -> str:
    v = args.get("variant")
    if v == "baseline":
        return "baseline"
    shape = "Full" if args.get("blocks") is None else f"N={args['blocks']}"
    rank = "" if v == "attnres" else f" r={args.get('rank')}"
    return f"{v} {shape}{rank}"


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    width = result["bucket_width"]
    factors = result["factors"]
    fig, axes = plt.subplots(1, len(factors), figsize=(5 * len(factors), 3.6), squeeze=False)
    for ax, f in zip(axes[0], factors, strict=True):
        for name, r in runs.items():
            b = r["loss_by_position"][str(f)]["buckets"]
            ax.plot([width * (i + 0.5) for i in range(len(b))], b, marker=".", label=name)
        ax.axvline(result["train_len"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{f}x training length ({f * result['train_len']} tokens)")
        ax.set_xlabel("position")
        ax.set_ylabel("loss (nats)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "loss_by_position.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, r in runs.items():
        gaps = sorted(int(g) for g in r["copy_probe"])
        ax.plot(gaps, [r["copy_probe"][str(g)]["second_loss"] for g in gaps], marker="o",
                label=f"{name} (2nd)")  # fmt: skip
    first = [r["copy_probe"][str(g)]["first_loss"] for r in runs.values() for g in gaps]
    ax.axhline(sum(first) / len(first), color="grey", ls="--", lw=0.8, label="1st (mean)")
    ax.set_xlabel("gap between the occurrences (tokens)")
    ax.set_ylabel("loss on the repeated span (nats)")
    ax.set_title(f"copy probe: {result['span']}-token function heads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "copy_probe.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def evaluate(model, flat, spans, *, train_len, factors, max_tokens, gaps, seed=0) -> dict:
    """One model's loss by position (per factor) and copy probe."""
    width = max(1, train_len // 4)
    by_pos = {}
    for f in factors:
        length = f * train_len
        losses, n = position_losses(model, flat, length, max(1, max_tokens // length))
        by_pos[str(f)] = {"sequences": n, "buckets": buckets(losses, width)}
    probe = copy_probe(model, spans, flat, gaps, seed)
    return {"loss_by_position": by_pos, "copy_probe": {str(g): v for g, v in probe.items()}}


def compare_with_baseline(result: dict) -> None:
    """Adds ``vs_baseline`` to every run: bucket losses and second-occurrence losses minus the
    baseline's (negative = better than the plain residual)."""
    base = result["runs"].get("baseline")
    if base is None:
        return
    for r in result["runs"].values():
        r["vs_baseline"] = {
            "loss_by_position": {
                f: [a - b for a, b in zip(v["buckets"], base["loss_by_position"][f]["buckets"])]
                for f, v in r["loss_by_position"].items()
            },
            "copy_second_loss": {
                g: v["second_loss"] - base["copy_probe"][g]["second_loss"]
                for g, v in r["copy_probe"].items()
            },
        }


def main(argv=None) -> int:
    from tokenizers import Tokenizer

    from titan_lrattnres.evaluation.generate import max_seq_len
    from titan_lrattnres.evaluation.inference import (
        default_validation_source,
        load_model,
        validation_tokens,
    )

    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.longctx",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", nargs="+", required=True, help="run folders (or checkpoints)")
    p.add_argument("--out", required=True)
    p.add_argument("--train-len", type=int, default=256, help="the runs' training length")
    p.add_argument("--factors", default="1,2,4")
    p.add_argument("--tokens", type=int, default=65536, help="held-out tokens per length")
    p.add_argument("--span", type=int, default=48, help="copy probe: tokens per occurrence")
    p.add_argument("--gaps", default="0,128,384,896", help="copy probe: filler lengths")
    p.add_argument("--probes", type=int, default=32, help="copy probe: functions")
    p.add_argument("--val-jsonl", help="held-out documents (default: the embedded corpus)")
    p.add_argument("--tokenizer", help="tokenizer.json for --val-jsonl")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    factors = [int(f) for f in ns.factors.split(",")]
    gaps = [int(g) for g in ns.gaps.split(",")]
    default = default_validation_source()
    jsonl = Path(ns.val_jsonl) if ns.val_jsonl else (default[0] if default else None)
    tok_path = Path(ns.tokenizer) if ns.tokenizer else (default[1] if default else None)
    if jsonl is None or tok_path is None:
        raise SystemExit("error: no held-out text: build the corpus (make data) or --val-jsonl")
    longest = max(max(factors) * ns.train_len, 2 * ns.span + max(gaps) - 1)  # model inputs
    tok = Tokenizer.from_file(str(tok_path))
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines() if line]
    all_spans = function_spans(texts, lambda s: tok.encode(s).ids, ns.span)
    if not all_spans:
        raise SystemExit(f"error: no function of >= {ns.span} tokens in {jsonl}")
    spans = random.Random(ns.seed).sample(all_spans, min(ns.probes, len(all_spans)))
    flat = validation_tokens(jsonl, tok_path, 10**9)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"train_len": ns.train_len, "factors": factors, "bucket_width": ns.train_len // 4,
              "span": ns.span, "gaps": gaps, "data": str(jsonl), "runs": {}}  # fmt: skip
    for run in ns.runs:
        model, args = load_model(run)
        if max_seq_len(model) < longest:
            raise SystemExit(
                f"error: {run}: max_seq_len {max_seq_len(model)} < the longest input {longest}"
            )
        name = _label(args)
        print(f"{name}: {run}", flush=True)
        r = evaluate(model, flat, spans, train_len=ns.train_len, factors=factors,
                     max_tokens=ns.tokens, gaps=gaps, seed=ns.seed)  # fmt: skip
        result["runs"][name] = {"run": str(run), "model_args": args, **r}
        for f in factors:
            b = r["loss_by_position"][str(f)]["buckets"]
            print(f"  {f}x: loss first bucket {b[0]:.3f}, last bucket {b[-1]:.3f}", flush=True)
        for g in gaps:
            c = r["copy_probe"][str(g)]
            print(f"  copy gap {g}: 1st {c['first_loss']:.3f} -> 2nd {c['second_loss']:.3f}")
    compare_with_baseline(result)
    (out / "longctx.json").write_text(json.dumps(result, indent=2) + "\n")
    for path in plot(result, out):
        print(f"wrote {path}")
    print(f"wrote {out / 'longctx.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
