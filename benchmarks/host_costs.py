"""What a routed step's depth machinery costs per call, where a step is host work (a tiny width).

    python -m benchmarks.host_costs [--layers 24 --dim 64 --seq 32] [--variants baseline,block8]
        [--calls 300] [--json PATH]

For each variant (``benchmarks.overhead``'s models, every sublayer compiled) one forward is
recorded and then, call by call, in microseconds (median of 5 runs of ``--calls`` calls):

- each compiled sublayer call by kind (attention, MLP) and by the form of its input (``plain``:
  h itself; ``cast``: a block end's phase-1 read; ``merge``: a phase-1 read merged with the
  partial inside the graph): forward (autograd recording, as in training) and forward +
  backward (the output's sum);
- the phase-1 read (``custom_ops.block_read``) at the model's source counts, forward and
  forward + backward;
- the median forward split into the router's own time (its bookkeeping and the phase-1 reads) and
  the sublayer calls'.

The table says which of these a routed step adds over the baseline's, and by how much: the
host-bound step's overhead read per call instead of per step (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.meta import environment, write
from benchmarks.overhead import Shape, build


def _us(fn, calls: int) -> float:
    """Median over 5 runs of ``calls`` calls of ``fn``, microseconds per call."""
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def _form(read) -> str:
    return "plain" if read is None else ("cast" if read[1] is None else "merge")


def _leaf(x):
    """``x`` cut from the recorded forward's graph as it was (a parameter stays itself: the
    compiled graph's guards tell them apart)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def sublayer_calls(model, tokens, calls: int) -> dict[str, dict[str, float]]:
    """``{"<kind> <form>": {"forward", "forward_backward"}}`` in us per call, one
    sublayer of each kind and form, on the inputs one forward handed it."""
    seen, run = {}, model.run_depth

    def recording(embedding, fn, on_read=None):
        def call(j, layer, h, read):
            kind = "attention" if layer.attention is not None else "mlp"
            seen.setdefault(f"{kind} {_form(read)}", (layer, h, read))
            return fn(j, layer, h, read)

        return run(embedding, call, on_read)

    model.run_depth = recording
    try:
        model(tokens)
    finally:
        del model.run_depth
    out = {}
    for name, (layer, h, read) in sorted(seen.items()):
        h = _leaf(h)
        read = None if read is None else tuple(_leaf(x) for x in read)

        def forward(layer=layer, h=h, read=read):
            y = layer(h, None, None, read)
            return y[0] if isinstance(y, tuple) else y

        out[name] = {
            "forward": _us(forward, calls),
            "forward_backward": _us(lambda f=forward: f().sum().backward(), calls),
        }
    return out


def phase1_calls(model, seq: int, calls: int) -> dict[int, dict[str, float]]:
    """``{sources: {"forward", "forward_backward"}}`` of the model's phase-1 read as its
    router runs it in a training step (``depth._KeptRead`` over the forward's
    ``custom_ops.SourceBank``: its variant, rank, one block's queries; ``seq`` tokens), in us per
    call, at the model's first, middle and last source counts. Each read has the sources no
    earlier read took (one; two for Full, read in pairs of sites), whose gradient sums it hands
    on; the others' sums it adds to."""
    import custom_ops
    from titan_lrattnres.model.depth import _BankRead, _KeptRead

    router, d = model.router, model.config.dim
    # a read at each block end, with one more source each; Full reads at every other site,
    # for two sites, with two more sources each
    step = 2 if router.reads_pairs else 1
    points = len(router.ends) // step
    counts = sorted({1, 1 + step * (points // 2), 1 + step * (points - 1)})
    c = router.num_sublayers // points
    out = {}
    for s in counts:
        values = [torch.randn(1, seq, d, requires_grad=True) for _ in range(s)]
        keys = None
        if router.projected:
            keys = [torch.randn(1, seq, router.rank, requires_grad=True) for _ in range(s)]
        queries = [torch.randn(router.rank, requires_grad=True) for _ in range(c)]
        bank = custom_ops.SourceBank(router.eps, router.backend)
        bank.extend(values, keys)
        fresh = max(s - step, 0)
        held, inputs = _BankRead.taken(values, keys, fresh)
        read = _BankRead(s, c, router.projected, router.eps, router.backend, bank, fresh, held)
        inputs += queries

        def forward(read=read, inputs=inputs):
            return _KeptRead.apply(read, *inputs)

        def forward_backward(forward=forward):
            outs = forward()
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        out[s] = {"forward": _us(forward, calls), "forward_backward": _us(forward_backward, calls)}
    return out


def forward_split(model, tokens, rounds: int = 40) -> dict[str, float]:
    """One forward's ms: its whole, the router's own (``step`` and ``start``: bookkeeping and
    phase-1 reads) and the sublayer calls', of the median of ``rounds`` forwards (ranked by
    the whole)."""
    router, spent = model.router, {"router": 0.0, "sublayers": 0.0}

    def timed(key, fn):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key] += time.perf_counter() - t0

        return call

    router.step, router.start = timed("router", router.step), timed("router", router.start)
    run = model.run_depth
    model.run_depth = lambda e, fn, on_read=None: run(e, timed("sublayers", fn), on_read)
    rows = []
    try:
        for _ in range(rounds):
            spent.update(router=0.0, sublayers=0.0)
            t0 = time.perf_counter()
            model(tokens)
            rows.append((time.perf_counter() - t0, spent["router"], spent["sublayers"]))
    finally:
        del router.step, router.start, model.run_depth
    median = sorted(rows)[len(rows) // 2]  # the median forward, split as it ran
    return dict(zip(("forward", "router", "sublayers"), (1e3 * t for t in median)))


def measure(shape: Shape, variants, calls: int, progress=print) -> dict:
    """Per variant: ``sublayers`` (:func:`sublayer_calls`), ``forward_ms``
    (:func:`forward_split`) and, routed, ``phase1`` (:func:`phase1_calls`)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (1, shape.seq), generator=g)
    result = {}
    for name in variants:
        model = build(name, shape, "cpu", torch.float32)
        for _ in range(3):
            model(tokens).sum().backward()
        model.zero_grad(set_to_none=True)
        row = {"sublayers": sublayer_calls(model, tokens, calls),
               "forward_ms": forward_split(model, tokens)}  # fmt: skip
        if hasattr(model, "router") and model.router.variant != "baseline":
            row["phase1"] = phase1_calls(model, shape.seq, calls)
        result[name] = row
        progress(f"  measured {name}")
    return result


def table(result: dict) -> str:
    lines = ["| variant | call | forward us | forward + backward us |", "|---|---|---|---|"]
    for name, row in result.items():
        for call, t in row["sublayers"].items():
            lines.append(f"| {name} | sublayer: {call} | {t['forward']:.0f} | "
                         f"{t['forward_backward']:.0f} |")  # fmt: skip
        for s, t in row.get("phase1", {}).items():
            lines.append(f"| {name} | phase-1 read, {s} sources | {t['forward']:.0f} | "
                         f"{t['forward_backward']:.0f} |")  # fmt: skip
    lines += ["", "| variant | forward ms | router's own ms | sublayer calls ms |",
              "|---|---|---|---|"]  # fmt: skip
    for name, row in result.items():
        f = row["forward_ms"]
        lines.append(f"| {name} | {f['forward']:.2f} | {f['router']:.2f} | {f['sublayers']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--variants", default="baseline,block8,sliced8_r64,projected8_r32")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from titan_lrattnres.training.cpu import keep_freed_memory

    keep_freed_memory()  # as the trainer and benchmarks.overhead run on CPU
    shape = Shape(layers=args.layers, dim=args.dim, seq=args.seq, heads=args.heads)
    variants = [v for v in args.variants.split(",") if v]
    result = measure(shape, variants, args.calls)
    print(table(result))
    if args.json:
        write(args.json, {"config": {**vars(args), **environment("cpu")}, "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
