"""What one layer costs: a single compiled layer's forward, and forward + backward, per variant.

    python -m benchmarks.layer_cost --layers 24 --dim 64 --seq 32 --heads 4 --layer 13
        [--variants torchtitan,baseline,block8,block8@reference] [--cpp-wrapper] [--json PATH]

Where ``benchmarks.overhead`` times whole steps, this isolates the unit that differs: layer
``--layer`` of each variant's model (``benchmarks.overhead.build``, weights from one seed),
compiled alone with ``fullgraph=True`` (Inductor), fed what it gets in a step (the routed
layer: the sources, keys and partial that the layers before it made, computed once without
gradient), every input requiring a gradient. A call is the layer's forward, or its forward and
a backward of all its outputs. Each round times ``--calls`` calls of every variant in turn;
reported: the median over ``--rounds`` rounds (microseconds a call) and each variant's ratio
to the first. The forward is timed once more with dynamo's guard evaluation skipped
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: safe here, every call passes the
same inputs); the difference is what checking the layer's guards costs a call.
``--cpp-wrapper`` runs the compiled graphs' wrappers in C++ instead of Python (Inductor's
``cpp_wrapper``), for every variant: what the host would cost without Python between the
kernels. A variant that cannot compile so (the registered read op returns a list
of tensors, which the C++ wrapper cannot call yet) is recorded with its error.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.meta import environment, write
from benchmarks.overhead import Shape, build


def layer_call(name: str, shape: Shape, index: int, seed: int = 0, backend: str = "inductor"):
    """``(call(backward: bool), plan)``: one call of layer ``index`` of variant ``name``,
    compiled with ``backend``; its inputs are what the layers before it give in a forward.
    ``call.outputs()`` runs the forward alone and gives every tensor the layer returns."""
    model = build(name, shape, "cpu", torch.float32, compile_=False, seed=seed)
    layers = list(model.layers.values())
    if not 0 <= index < len(layers):
        raise ValueError(f"--layer {index}: the model has layers 0..{len(layers) - 1}")
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq),
                           generator=torch.Generator().manual_seed(seed))  # fmt: skip
    layer = layers[index]

    def grad(t):
        return None if t is None else t.detach().clone().requires_grad_()

    with torch.no_grad():
        embedding = model.tok_embeddings(tokens)
        if name.partition("@")[0] == "torchtitan":
            args = (grad(embedding), None)  # (x, attention_masks)
        else:
            before = {id(earlier) for earlier in layers[:index]}

            def upto(layer, h, values, keys, partial, partial_key):  # the layers before index
                if id(layer) in before:
                    return layer(h, values, keys, partial, partial_key)
                return h, [], [], partial, partial_key

            stream = model.run_layers(model.start(embedding), upto)
            h, values, keys, partial, partial_key = stream
            values = None if values is None else [grad(v) for v in values]
            keys = None if keys is None else [grad(k) for k in keys]
            args = (grad(h), values, keys, grad(partial), grad(partial_key))
    layer.compile(fullgraph=True, backend=backend)

    def outputs():  # every tensor the layer returns, lists flattened
        out = layer(*args)
        flat = []
        for o in out if isinstance(out, tuple) else (out,):
            flat += [t for t in (o if isinstance(o, (list, tuple)) else (o,)) if t is not None]
        return flat

    def call(backward: bool):
        outs = outputs()
        if backward:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    call.outputs = outputs
    return call, getattr(layer, "plan", None)


# (backward, result key, guards evaluated): each round times every variant so, in this order
TIMINGS = (
    (False, "fwd_us", True),
    (True, "fwd_bwd_us", True),
    (False, "fwd_unguarded_us", False),
)


def measure(shape, variants, index, rounds=7, calls=100, warmup=5, backend="inductor") -> dict:
    """Every variant built and warmed first; then each round times ``calls`` calls of every
    variant in turn (forward, then forward + backward), so a drift of the machine reaches all
    variants alike. A variant that fails to build or run is recorded with its error."""
    result, runs = {}, {}
    for name in variants:
        try:
            call, plan = layer_call(name, shape, index, backend=backend)
            for _ in range(warmup):
                call(True)
            runs[name] = call
            result[name] = {"plan": None if plan is None else repr(plan),
                            **{key: [] for _, key, _ in TIMINGS}}  # fmt: skip
        except Exception as e:  # recorded: the other variants still run
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"  {name}: {result[name]['error']}", flush=True)
    for _ in range(rounds):
        for name, call in runs.items():
            for backward, key, guarded in TIMINGS:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=not guarded):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        call(backward)
                    result[name][key].append(1e6 * (time.perf_counter() - t0) / calls)
    for name in runs:
        row = result[name]
        for _, key, _ in TIMINGS:
            row[f"median_{key}"] = statistics.median(row[key])
        row["guards_us"] = row["median_fwd_us"] - row["median_fwd_unguarded_us"]
    return result


def table(result: dict) -> str:
    first = next((r for r in result.values() if "error" not in r), None)
    lines = ["| variant | forward us | ratio | forward + backward us | ratio | guards us |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in result.items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - ({r['error'][:80]}) |")
            continue
        f, fb = r["median_fwd_us"], r["median_fwd_bwd_us"]
        ratios = f / first["median_fwd_us"], fb / first["median_fwd_bwd_us"]
        lines.append(f"| {name} | {f:.0f} | {ratios[0]:.2f}x | {fb:.0f} | {ratios[1]:.2f}x | "
                     f"{r['guards_us']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    Shape.add_arguments(p, layers=24, dim=64, seq=32, heads=4)
    p.add_argument("--layer", type=int, default=13, help="which layer (0-based)")
    p.add_argument("--variants", default="torchtitan,baseline,block8,block8@reference")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--cpp-wrapper", action="store_true", help="Inductor's C++ wrapper")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.calls < 1:
        p.error("--rounds and --calls must be >= 1")
    shape = Shape.of(a)
    variants = [v for v in a.variants.split(",") if v]
    print(f"layer_cost: layer {a.layer} of L={a.layers} d={a.dim} T={a.seq} B={a.batch}, "
          f"{a.rounds} rounds of {a.calls} calls, C++ wrapper: {a.cpp_wrapper}")  # fmt: skip
    import torch._inductor.config as inductor_config

    with inductor_config.patch(cpp_wrapper=a.cpp_wrapper):
        result = measure(shape, variants, a.layer, a.rounds, a.calls)
    print(table(result))
    if a.json:
        write(a.json, {"config": dict(vars(a), **environment("cpu")), "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
