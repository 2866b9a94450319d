"""Routing analysis: what the depth reads of a trained model attend to (docs/method.md §6).

For every read site t = 1..2L the routing weights over its sources are recomputed with the eager
reference maths (``custom_ops.reference.depth_logits`` + softmax, fp32) while the model's own
forward runs unchanged (:func:`capture_routing` runs the model's own depth loop,
``LRAttnResModel.run_layers``, each layer through ``Layer.run`` with an ``on_read`` that sees
every site's whole source set and query), so the analysed numbers are those of the model,
whatever depth backend it uses.

Per site, over all analysed tokens (α ``[S_t, tokens]``):
- mean routing weight per source slot (source slot = position in S_t: embedding, then
  blocks / outputs in depth order, the partial last) -> heatmap;
- normalised entropy ``H / log|S_t|`` and effective number of sources ``exp(H)``, with
  ``H = -Σ_s α_s log α_s`` per token, averaged over tokens;
- top-1 mass ``max_s α_s``, averaged over tokens;
- input dependence: mean over sources of the std over tokens of α_s (0 = static routing).
Averages over sites skip sites with |S_t| = 1 (entropy undefined; none exist for t >= 1).

    python -m titan_lrattnres.analysis --run DIR [--tokens N] --out DIR [--generated]

``--generated`` analyses the model's routing on its OWN samples: each batch row starts from
``--prompt-len`` tokens of the data and is continued by the model (KV-cached decoding,
``--temperature`` with a seeded generator) to ``--seq-len`` tokens; the report compares it with
the routing on the data it was prompted from.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from custom_ops import reference
from custom_ops.schedule import site_sources
from titan_lrattnres.components.integrity import unpickle_error


@dataclass
class SiteStats:
    site: int
    num_sources: int
    labels: list[str]
    mean_weight: list[float]
    norm_entropy: float | None
    eff_sources: float
    top1_mass: float
    input_dependence: float


def source_labels(
    t: int, num_sublayers: int, num_blocks: int | None, *, block_layers: int | None = None
) -> list[str]:
    """Names of S_t: ``e``; ``o{j}`` (Full); ``B{n}`` completed blocks; ``P{n}`` the partial.
    The schedule is ``num_blocks`` or ``block_layers`` as in ``custom_ops.schedule``."""
    if block_layers is None and num_blocks in (None, num_sublayers):  # Full: one output a block
        return ["e"] + [f"o{j}" for j in range(1, t + 1)]
    short = {"embedding": "e", "block": "B", "partial": "P"}
    return [
        "e" if kind == "embedding" else f"{short[kind]}{n}"
        for kind, n in site_sources(t, num_sublayers, num_blocks, block_layers=block_layers)
    ]


@torch.no_grad()
def capture_routing(model, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the model on ``tokens [B, T]``; return ``(logits, alphas)`` where ``alphas[t-1]`` is
    read site t's routing weights ``[S_t, B, T]`` (fp32, sums to 1 over dim 0)."""
    router = model.router
    if router.variant == "baseline":
        raise ValueError("the baseline variant has no depth routing (standard residual stream)")
    alphas = []

    def on_read(t, values, keys, query):
        if keys is None:
            keys = reference.sliced_keys(values, router.rank)
        logits = reference.depth_logits(keys, query, router.eps)
        alphas.append(torch.softmax(logits, dim=0))

    def call(layer, *stream):
        def attend(x):
            return layer.attention(x, None, None)

        return layer.run(attend, *stream, on_read=on_read)

    h = model.run_layers(model.start(model.tok_embeddings(tokens)), call)[0]
    return model.lm_head(model.norm(h)), alphas


def site_stats(t: int, alpha: torch.Tensor, labels: list[str]) -> SiteStats:
    """Statistics of one read site from its weights ``alpha [S, ...]``."""
    s = alpha.shape[0]
    a = alpha.reshape(s, -1).double()
    ent = -(a * a.clamp_min(1e-30).log()).sum(0)  # [tokens]
    return SiteStats(
        site=t,
        num_sources=s,
        labels=labels,
        mean_weight=a.mean(1).tolist(),
        norm_entropy=(ent / math.log(s)).mean().item() if s > 1 else None,
        eff_sources=ent.exp().mean().item(),
        top1_mass=a.max(0).values.mean().item(),
        input_dependence=a.std(1, unbiased=False).mean().item(),
    )


def summarise(stats: list[SiteStats]) -> dict[str, float]:
    """Averages over read sites with more than one source (comparable to docs/method.md §6)."""
    multi = [s for s in stats if s.num_sources > 1]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    return {
        "norm_entropy": mean([s.norm_entropy for s in multi]),
        "eff_sources": mean([s.eff_sources for s in multi]),
        "top1_mass": mean([s.top1_mass for s in multi]),
        "input_dependence": mean([s.input_dependence for s in multi]),
        "sites": len(multi),
    }


def analyse(model, batches) -> tuple[list[SiteStats], dict[str, float]]:
    """Routing statistics of ``model`` over an iterable of token batches ``[B, T]``."""
    router = model.router
    m, bl = router.num_sublayers, router.block_layers
    n = None if bl is not None else len(router.ends)
    labels = [source_labels(t, m, n, block_layers=bl) for t in range(1, m + 1)]
    per_site: list[list[torch.Tensor]] = [[] for _ in range(m)]
    for tokens in batches:
        _, alphas = capture_routing(model, tokens)
        for t, a in enumerate(alphas):
            per_site[t].append(a.reshape(a.shape[0], -1))
    stats = [
        site_stats(t, torch.cat(chunks, dim=1), labels[t - 1])
        for t, chunks in enumerate(per_site, start=1)
    ]
    return stats, summarise(stats)


def plot_heatmap(stats: list[SiteStats], path: str | Path, title: str = "") -> Path:
    """Heatmap of mean routing weight, read sites (rows) × source slots (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    width = max(s.num_sources for s in stats)
    grid = np.full((len(stats), width), np.nan)
    for i, s in enumerate(stats):
        grid[i, : s.num_sources] = s.mean_weight
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.5 * width), max(3.0, 1.2 + 0.35 * len(stats))))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=float(np.nanmax(grid)))
    ax.set_xlabel(
        "source slot = position in S_t\n(0 = embedding, then blocks / outputs in depth "
        "order, partial last)",
        fontsize=8,
    )
    ax.set_ylabel("read site t")
    ax.set_xticks(range(width))
    ax.set_yticks(range(len(stats)), [str(s.site) for s in stats])
    if width * len(stats) <= 400:
        for i, s in enumerate(stats):
            for k, (w, lab) in enumerate(zip(s.mean_weight, s.labels, strict=True)):
                ax.text(
                    k,
                    i,
                    f"{lab}\n{w:.2f}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if w < 0.6 * np.nanmax(grid) else "black",
                )
    fig.colorbar(im, ax=ax, label="mean routing weight α")
    ax.set_title(title or "mean routing weight per read site")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_report(stats: list[SiteStats], summary: dict, header: str = "") -> str:
    lines = [f"# Routing analysis{(': ' + header) if header else ''}", ""]
    lines += [
        "| site t | S_t | sources | norm. entropy | eff. sources | top-1 mass | input dep. |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in stats:
        ne = "-" if s.norm_entropy is None else f"{s.norm_entropy:.3f}"
        lines.append(
            f"| {s.site} | {s.num_sources} | {' '.join(s.labels)} | {ne} | "
            f"{s.eff_sources:.2f} | {s.top1_mass:.3f} | {s.input_dependence:.4f} |"
        )
    lines += [
        "",
        f"Averages over {summary['sites']} read sites with |S_t| > 1 (paper, docs/method.md §6: "
        "low-rank ≈0.86 / ≈13-15 / ≈0.3, standard ≈0.67 / ≈6 / ≈0.5 at L=24):",
        "",
        "| norm. entropy | eff. sources | top-1 mass | input dep. |",
        "|---|---|---|---|",
        f"| {summary['norm_entropy']:.3f} | {summary['eff_sources']:.2f} | "
        f"{summary['top1_mass']:.3f} | {summary['input_dependence']:.4f} |",
        "",
    ]
    return "\n".join(lines)


# -- data ------------------------------------------------------------------------------------
def token_batches(
    num_tokens: int, batch: int, seq_len: int, vocab: int, *, tokens=None, seed: int = 0
):
    """Batches ``[batch, seq_len]`` totalling about ``num_tokens`` from ``tokens`` (a flat id
    tensor, e.g. the validation split) or, when None, random tokens (seeded)."""
    if tokens is not None:
        flat = tokens
    else:
        g = torch.Generator().manual_seed(seed)
        flat = torch.randint(0, vocab, (max(num_tokens, batch * seq_len),), generator=g)
    per = batch * seq_len
    n = max(1, min(num_tokens, flat.numel()) // per)
    if flat.numel() < per:
        raise ValueError(f"need at least {per} tokens, the token source has {flat.numel()}")
    return [flat[i * per : (i + 1) * per].reshape(batch, seq_len).long() for i in range(n)]


def load_token_file(path) -> torch.Tensor:
    """Token ids ``[n]`` (int64) from a ``.npy`` (no pickled objects), a ``.pt`` / ``.pth``
    tensor (``weights_only``: no code runs) or a raw uint16 file; ``ValueError`` (one line)
    for anything else."""
    import numpy as np

    path = Path(path)
    try:
        if path.suffix == ".npy":
            ids = torch.from_numpy(np.load(path, allow_pickle=False).astype("int64"))
        elif path.suffix in (".pt", ".pth"):
            ids = torch.load(path, weights_only=True, map_location="cpu")
        else:
            ids = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype("int64"))
    except Exception as e:
        raise ValueError(f"--tokens-file {path} refused: {unpickle_error(e)}") from e
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"--tokens-file {path} holds a {type(ids).__name__}, not a tensor")
    return ids.flatten().long()


def pick_tokens(ns, vocab: int) -> tuple[str, torch.Tensor | None]:
    """The analysed data: --tokens-file, else --val-jsonl (or the built embedded corpus's
    validation split) when its tokenizer fits the model's vocabulary, else random tokens."""
    from titan_lrattnres.evaluation.inference import default_validation_source, validation_tokens

    if ns.tokens_file:
        try:
            return ns.tokens_file, load_token_file(ns.tokens_file)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    source = None
    if ns.val_jsonl:
        default = default_validation_source()
        tok = ns.tokenizer or (default[1] if default else None)
        if tok is None:
            raise SystemExit("--val-jsonl needs --tokenizer tokenizer.json")
        source = (Path(ns.val_jsonl), Path(tok))
    elif not ns.random:
        source = default_validation_source()
    if source is not None:
        flat = validation_tokens(*source, ns.tokens)
        if int(flat.max()) < vocab:
            return f"validation split {source[0]}", flat
        print(f"{source[1]} does not fit the model vocabulary ({vocab}); using random tokens")
    return "random tokens", None


@torch.no_grad()
def generated_batches(
    model, batches, prompt_len: int, temperature: float, seed: int, compile: bool = False
):
    """Each batch's rows cut to ``prompt_len`` tokens and continued by ``model`` to their length
    (``titan_lrattnres.evaluation.generate.generate``, KV cache, seeded sampling; ``compile``:
    its compiled prefill and decode steps, compiled once for every batch)."""
    from titan_lrattnres.evaluation.generate import CompiledForward, generate

    compiled = CompiledForward(model) if compile else False
    out = []
    for i, b in enumerate(batches):
        if not 1 <= prompt_len < b.shape[1]:
            raise ValueError(f"--prompt-len must be in [1, {b.shape[1] - 1}], got {prompt_len}")
        n = b.shape[1] - prompt_len
        prompt = b[:, :prompt_len]
        out.append(
            generate(model, prompt, n, temperature=temperature, seed=seed + i, compiled=compiled)
        )
    return out


def main(argv=None) -> int:
    from titan_lrattnres.evaluation.inference import add_checkpoint_args, load_from_cli

    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.analysis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint_args(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tokens", type=int, default=16384, help="tokens to analyse")
    p.add_argument("--tokens-file", help="token ids (.npy/.pt/uint16 .bin)")
    p.add_argument(
        "--val-jsonl",
        help='validation documents {"text": ...} (default: the built '
        "embedded corpus's val.jsonl); tokenised with --tokenizer",
    )
    p.add_argument("--tokenizer", help="tokenizer.json for --val-jsonl")
    p.add_argument("--random", action="store_true", help="analyse random tokens")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generated", action="store_true", help="analyse the model's own continuations")
    p.add_argument("--prompt-len", type=int, default=16, help="--generated: prompt tokens")
    p.add_argument("--temperature", type=float, default=1.0, help="--generated: sampling")
    p.add_argument(
        "--compile", action="store_true", help="--generated: compiled prefill and decode steps"
    )
    ns = p.parse_args(argv)
    model, args, _ = load_from_cli(ns)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.get('variant')} blocks={args.get('blocks')} r={args.get('rank')}"
    if model.router.variant == "baseline":
        msg = "baseline variant: standard residual stream, no depth routing to analyse"
        (out / "routing.json").write_text(
            json.dumps({"model_args": args, "routing": None, "note": msg}, indent=2)
        )
        (out / "routing.md").write_text(f"# Routing analysis\n\n{msg}.\n")
        print(msg)
        return 0
    vocab = model.vocab_size  # real ids only (the embedding rows are padded)
    data, flat = pick_tokens(ns, vocab)
    batches = token_batches(ns.tokens, ns.batch, ns.seq_len, vocab, tokens=flat, seed=ns.seed)
    prompted = None
    if ns.generated:
        prompted = analyse(model, batches)[1]
        batches = generated_batches(
            model, batches, ns.prompt_len, ns.temperature, ns.seed, compile=ns.compile
        )
        data = (
            f"the model's own samples (temperature {ns.temperature}, {ns.prompt_len}-token "
            f"prompts from {data})"
        )
    stats, summary = analyse(model, batches)
    ntok = sum(b.numel() for b in batches)
    header = f"{name}, {ntok} tokens of {data}"
    plot_heatmap(stats, out / "routing_heatmap.png", title=name)
    md = markdown_report(stats, summary, header)
    if prompted is not None:
        md += "\n| averaged over sites | own samples | the prompting data |\n|---|---|---|\n"
        md += "".join(f"| {k} | {summary[k]:.3f} | {prompted[k]:.3f} |\n" for k in summary)
    (out / "routing.md").write_text(md)
    (out / "routing.json").write_text(
        json.dumps(
            {
                "model_args": args,
                "tokens": ntok,
                "data": str(data),
                "summary": summary,
                "summary_on_prompt_data": prompted,
                "sites": [asdict(s) for s in stats],
            },
            indent=2,
        )
    )
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
