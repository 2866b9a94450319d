"""One-shot GPU check (torch 2.11 + CUDA, no torchtitan): op registration and parity on the
device, op bandwidth, and a layer-stack training step per variant. See gpu_check.sh.

Every section records its result or its error in the JSON (written after each section), so one
failure never hides the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

import custom_ops
from benchmarks import layer_stack
from benchmarks import ops as op_bench
from custom_ops import reference

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_ops(device, dry):
    """opcheck every op (both impls) and compare every backend with the reference on device."""
    out = {"opcheck": {}, "parity": {}}
    lead, d, r, s = ((2, 7), 40, 8, 3) if dry else ((4, 300), 1000, 64, 9)
    impls = ["compiled"] + (["triton"] if device.type == "cuda" else [])
    ops = torch.ops.lrattnres
    for impl in impls:
        v = [torch.randn(*lead, d, device=device, requires_grad=True) for _ in range(s)]
        k = [torch.randn(*lead, r, device=device, requires_grad=True) for _ in range(s)]
        q = torch.randn(r, device=device, requires_grad=True)
        bank = torch.randn(3, r, device=device, requires_grad=True)
        o1 = torch.randn(*lead, d, device=device, requires_grad=True)
        l1 = torch.randn(*lead, device=device, requires_grad=True)
        cases = {
            "depth_read": (ops.depth_read.default, (v, k, q, 1e-6, impl)),
            "depth_read_sliced": (ops.depth_read_sliced.default, (v, q, 1e-6, impl)),
            "block_read": (ops.block_read.default, (v, k, bank, 1e-6, impl)),
            "block_read_sliced": (ops.block_read_sliced.default, (v, bank, 1e-6, impl)),
            "merge_partial": (ops.merge_partial.default, (o1, l1, v[0], None, q, 1e-6, True, impl)),
        }
        for name, (op, args) in cases.items():
            try:
                torch.library.opcheck(op, args)
                out["opcheck"][f"{name}/{impl}"] = "ok"
            except Exception as e:  # noqa: BLE001 (reported, not hidden)
                out["opcheck"][f"{name}/{impl}"] = f"FAIL: {e}"[:2000]
    for backend in ["compiled"] + (["triton"] if device.type == "cuda" else []):
        for dtype in (torch.float32, torch.bfloat16):
            for sliced in (True, False):
                v, k, q = op_bench.make_inputs(lead[0] * lead[1], d, r, s, sliced, dtype, device)
                grad = torch.randn(lead[0] * lead[1], d, device=device).to(dtype)
                err = op_bench.check(backend, v, k, q, grad)
                key = f"depth_read/{backend}/{str(dtype)[6:]}/{'sliced' if sliced else 'projected'}"
                out["parity"][key] = {"max_rel_err": err, "ok": err <= TOL[dtype]}
                kk = None if sliced else k
                o, lse = custom_ops.block_read(v[:-1], None if sliced else k[:-1], q[None],
                                               backend=backend)  # fmt: skip
                h = custom_ops.merge_partial(o[0], lse[0], v[-1], None if sliced else k[-1], q,
                                             backend=backend)  # fmt: skip
                ref_k = kk if kk is not None else reference.sliced_keys(v, r)
                err = _rel(h, reference.depth_read(v, ref_k, q))
                out["parity"][key.replace("depth_read", "two_phase")] = {
                    "max_rel_err": err, "ok": err <= TOL[dtype]}  # fmt: skip
    out["all_ok"] = all(x == "ok" for x in out["opcheck"].values()) and all(
        p["ok"] for p in out["parity"].values()
    )
    return out


def layer_step_times(device, dry, repeats):
    """Per-variant step time (compiled sublayers, fwd+bwd+AdamW), interleaved, medians."""
    if dry:
        cfg = dict(layers=2, d=64, heads=4, blocks=2, vocab=128)
        batch, seq = 1, 16
    else:
        cfg = dict(layers=24, d=1024, heads=16, blocks=8, vocab=32768)
        batch, seq = 1, 2048
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = ["baseline", "block", "sliced", "projected"]
    steps, out = {}, {"config": {**cfg, "batch": batch, "seq": seq, "dtype": str(dtype)}}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (batch, seq), generator=g).to(device)
    targets = torch.randint(0, cfg["vocab"], (batch, seq), generator=g).to(device)
    for name in variants:
        model = layer_stack.Stack(name, **cfg).to(device, dtype)
        for sub in model.sublayers:
            sub.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        step = layer_stack.step_fn(model, opt, tokens, targets)
        t0 = time.perf_counter()
        loss = step()  # compile + first step
        out[f"{name}_first_step_s"] = time.perf_counter() - t0
        out[f"{name}_loss0"] = float(loss)
        steps[name] = step
    times = {n: [] for n in variants}
    for _ in range(repeats):  # interleaved so drift hits every variant alike
        for name in variants:
            times[name].append(op_bench.timeit(steps[name], device, repeat=1, warmup=0))
    med = {n: statistics.median(t) for n, t in times.items()}
    out["step_ms_median"] = {n: m * 1e3 for n, m in med.items()}
    out["ratio_to_baseline"] = {n: med[n] / med["baseline"] for n in variants}
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("json_path", nargs="?", default="benchmarks/results/gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, end to end")
    args = p.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    result = {"device": str(device), "torch": torch.__version__, "dry_run": dry}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    sections = {
        "ops_check": lambda: check_ops(device, dry),
        "op_bandwidth": lambda: op_bench.run(
            device,
            [(64, 96, 8, 3, True)]
            if dry
            else [(16384, d, 64, s, True) for d in (1024, 4096) for s in (5, 9, 17, 49)],
            torch.bfloat16 if device.type == "cuda" else torch.float32,
            repeat=2 if dry else 10,
        ),
        "layer_stack": lambda: layer_step_times(device, dry, repeats=2 if dry else 7),
    }
    for name, fn in sections.items():
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 (recorded; the other sections still run)
            result[name] = {"error": traceback.format_exc()[-4000:]}
        result[name + "_seconds"] = time.perf_counter() - t0
        print(f"[gpu_check] {name}: {result[name + '_seconds']:.1f}s", flush=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if "rows" in result.get("op_bandwidth", {}):
        op_bench.print_table(result["op_bandwidth"])
    print(json.dumps({k: result[k] for k in ("ops_check", "layer_stack") if k in result},
                     indent=1, default=str)[:6000])  # fmt: skip
    failed = [n for n in sections if "error" in result[n]]
    ok = not failed and result["ops_check"].get("all_ok", False)
    print(f"[gpu_check] {'OK' if ok else 'FAILED: ' + ', '.join(failed or ['ops_check'])}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
