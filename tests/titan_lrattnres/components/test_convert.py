"""Checkpoints from before the layer layout (``titan_lrattnres.components.convert``).

The earlier layouts -- per sublayer with one query per read site (``layers.{2i}.attention``,
``layers.{2i+1}.feed_forward``, ``router.query_<t> [r]``, ``router.embedding_key``), the
older one-bank one (``router.query_bank [2L, r]``), and layers holding the queries of sites
2i+1, 2i+2 (``layers.{i}.queries [2, r]``) -- are made from the layer layout by the inverse
mapping (:func:`to_old_layout`): of a model's and its optimisers' state, which converts
back into a model with the same outputs and optimisers that take the same next step; and of a
real run's step-2 checkpoint, which the trainer refuses by name with the command, and which
``python -m titan_lrattnres.convert`` turns into a folder from which training resumes with the
uninterrupted run's losses, bitwise."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.functional import cross_entropy

from tests import forkserver
from tests.titan_lrattnres.trainer_runs import ROOT, launch
from titan_lrattnres.components import convert, integrity
from titan_lrattnres.components.optimizers import recipe_param_groups
from titan_lrattnres.model.depth import layer_sites

LAYERS = 2  # the debug flavor (cpu_smoke)
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.(attention|feed_forward)(?=\.|$)")
_QUERIES = re.compile(r"(^|\.)layers\.(\d+)\.queries(?=\.|$)")
_KEY = re.compile(r"(^|\.)embedding_key(?=\.)")


def _old_name(key: str) -> str:
    def sublayer(m: re.Match) -> str:
        return f"{m[1]}layers.{2 * int(m[2]) + (m[3] == 'feed_forward')}.{m[3]}"

    return _KEY.sub(r"\1router.embedding_key", _LAYER.sub(sublayer, key))


def to_old_layout(state: dict, layout: str = "sites") -> dict:
    """The inverse of ``convert.to_layer_layout``: ``state`` (nested or flat) in an earlier
    layout: per sublayer with per-site queries (``sites``) or the one-bank
    ``router.query_bank`` (``bank``), or the layer layout with a ``[2, r]`` per layer, sites
    2i+1 and 2i+2 (``pairs``)."""
    out, by_site = {}, {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = to_old_layout(value, layout)
            continue
        m = _QUERIES.search(key)
        rename = (lambda k: k) if layout == "pairs" else _old_name
        if m is None:
            out[rename(key)] = value
            continue
        i, rows = int(m[2]), isinstance(value, torch.Tensor) and value.ndim >= 1
        parts = (rename(key[: m.start()]) + m[1], rename(key[m.end() :]))
        sites = layer_sites(i, i == LAYERS - 1)  # the site of each row, straight from the SPEC
        for row, t in enumerate(sites):
            by_site.setdefault(parts, {})[t] = value[row] if rows else value
    for (prefix, suffix), got in by_site.items():
        assert sorted(got) == list(range(1, 2 * LAYERS + 1)), prefix + suffix
        row = isinstance(got[1], torch.Tensor) and got[1].ndim >= 1
        if layout == "sites":
            for t, v in got.items():
                out[f"{prefix}router.query_{t}{suffix}"] = v
        elif layout == "bank":
            out[prefix + convert.OLD + suffix] = (
                torch.stack([got[t] for t in sorted(got)]) if row else got[1]
            )
        else:
            for i in range(LAYERS):
                pair = [got[2 * i + 1], got[2 * i + 2]]
                out[f"{prefix}layers.{i}.queries{suffix}"] = torch.stack(pair) if row else pair[0]
    return out


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# -- the mapping ----------------------------------------------------------------------------------
def test_per_site_and_bank_entries_by_hand():
    q = {t: torch.full((3,), float(t)) for t in range(1, 5)}
    sites = {
        "layers.0.attention.wo.weight": torch.zeros(1),
        "layers.1.feed_forward.w2.weight": torch.ones(1),
        "layers.2.attention.wo.weight": torch.full((1,), 2.0),
        "layers.3.feed_forward.w2.weight": torch.full((1,), 3.0),
        "router.embedding_key.weight": torch.full((1,), 4.0),
        **{f"router.query_{t}": q[t] for t in q},
        "optimizer": {
            **{f"state.router.query_{t}.exp_avg": -q[t] for t in q},
            **{f"state.router.query_{t}.step": torch.tensor(7.0) for t in q},
            **{f"param_groups.router.query_{t}.betas": (0.9, 0.95) for t in q},
            "state.layers.3.feed_forward.w2.weight.momentum_buffer": torch.ones(1),
            "param_groups.router.embedding_key.weight.lr": 0.1,
        },
        "train_state": {"step": 2},
    }
    out = convert.to_layer_layout(sites)
    assert sorted(k for k in out if k not in ("optimizer", "train_state")) == sorted(
        [
            "layers.0.attention.wo.weight",
            "layers.0.feed_forward.w2.weight",
            "layers.1.attention.wo.weight",
            "layers.1.feed_forward.w2.weight",
            "embedding_key.weight",
            "layers.0.queries",
            "layers.1.queries",
        ]
    )
    assert torch.equal(out["layers.1.feed_forward.w2.weight"], torch.full((1,), 3.0))
    assert torch.equal(out["layers.0.queries"], q[1][None])  # layer 0: site 1
    assert torch.equal(out["layers.1.queries"], torch.stack([q[2], q[3], q[4]]))  # and the final
    opt = out["optimizer"]
    assert torch.equal(opt["state.layers.0.queries.exp_avg"], -q[1][None])
    assert torch.equal(opt["state.layers.1.queries.exp_avg"], -torch.stack([q[2], q[3], q[4]]))
    assert opt["state.layers.1.queries.step"] == 7 and opt["state.layers.1.queries.step"].ndim == 0
    assert opt["param_groups.layers.0.queries.betas"] == (0.9, 0.95)
    assert "state.layers.1.feed_forward.w2.weight.momentum_buffer" in opt
    assert opt["param_groups.embedding_key.weight.lr"] == 0.1
    assert out["train_state"] == {"step": 2}

    bank = {k: v for k, v in sites.items() if "query_" not in k and k != "optimizer"}
    bank[convert.OLD] = torch.cat([q[t][None] for t in q])
    bank["optimizer"] = {
        "state.router.query_bank.step": torch.tensor(7.0),
        "param_groups.router.query_bank.lr": 0.3,
    }
    got = convert.to_layer_layout(bank)
    assert torch.equal(got["layers.0.queries"], out["layers.0.queries"])
    assert torch.equal(got["layers.1.queries"], out["layers.1.queries"])
    assert got["optimizer"]["param_groups.layers.1.queries.lr"] == 0.3
    assert got["optimizer"]["state.layers.0.queries.step"] == 7

    pairs = {k: v for k, v in sites.items() if "query_" not in k and k != "optimizer"}
    pairs = {**convert.to_layer_layout(pairs), "layers.0.queries": torch.stack([q[1], q[2]])}
    pairs["layers.1.queries"] = torch.stack([q[3], q[4]])
    pairs["optimizer"] = {"state.layers.1.queries.exp_avg": -torch.stack([q[3], q[4]]),
                          "state.layers.0.queries.exp_avg": -torch.stack([q[1], q[2]])}  # fmt: skip
    assert convert.old_layout(pairs) == (
        "'layers.0.queries' has 2 rows (a layer held read sites 2i+1 and 2i+2)"
    )
    got = convert.to_layer_layout(pairs)
    assert not convert.is_old_layout(got)
    assert torch.equal(got["layers.0.queries"], out["layers.0.queries"])
    assert torch.equal(got["layers.1.queries"], out["layers.1.queries"])
    assert torch.equal(got["optimizer"]["state.layers.1.queries.exp_avg"],
                       opt["state.layers.1.queries.exp_avg"])  # fmt: skip


def test_layouts_are_told_apart_and_bad_states_refused():
    new = ["layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight", "layers.0.queries"]
    new += ["embedding_key.weight", "optimizer.state.layers.0.queries.exp_avg"]
    assert not convert.is_old_layout(new)
    assert not convert.is_old_layout(["tok_embeddings.weight", "lm_head.weight"])
    baseline = ["layers.0.attention.wo.weight", "layers.1.feed_forward.w1.weight"]  # no router
    assert convert.is_old_layout(baseline)
    assert convert.is_old_layout(["optimizer.state.router.query_3.exp_avg"])
    assert convert.is_old_layout([convert.OLD])
    stored = [*baseline, "router.embedding_key.weight", "optimizer.state.router.query_1.step"]
    stored += ["layers.3.feed_forward.w1.weight"] + [f"router.query_{t}" for t in range(1, 5)]
    own = ["layers.1.queries", "layers.0.feed_forward.w1.weight", "embedding_key.weight"]
    assert convert.source_keys(own, stored) == [  # L = 2: layer 1 holds sites 2, 3 and 4
        "layers.1.feed_forward.w1.weight",
        "router.embedding_key.weight",
        "router.query_2",
        "router.query_3",
        "router.query_4",
    ]
    pairs = {
        f"layers.{i}.{m}": torch.ones(1) for i in (0, 1) for m in ("attention", "feed_forward")
    }
    pairs = {"layers.0.queries": torch.ones(2, 3), "layers.1.queries": torch.ones(2, 3), **pairs}
    assert convert.source_keys(["layers.0.queries"], pairs) == ["layers.0.queries"]
    assert convert.source_keys(["layers.1.queries"], pairs) == list(pairs)[:2]
    bank = ["layers.3.feed_forward.w1.weight", convert.OLD]  # L = 2
    assert convert.source_keys(["layers.1.queries"], bank) == [convert.OLD]
    with pytest.raises(ValueError, match=r"layers.1.attention.wo.weight: sublayer 1 cannot hold"):
        convert.to_layer_layout({"layers.1.attention.wo.weight": 0})
    with pytest.raises(ValueError, match=r"layers.i.queries: no entry for read sites \[2\]"):
        convert.to_layer_layout({**dict.fromkeys(baseline, 0), "router.query_1": torch.ones(2)})
    with pytest.raises(ValueError, match=r"read site 5 is not in 1..4"):
        convert.to_layer_layout({"router.query_5": torch.ones(2)}, layers=2)
    with pytest.raises(ValueError, match=r"router.query_bank: \(6, 2\) has no 4 query rows"):
        convert.to_layer_layout({convert.OLD: torch.ones(6, 2)}, layers=2)
    steps = {f"state.router.query_{t}.step": torch.tensor(float(t)) for t in (1, 2)}
    with pytest.raises(ValueError, match=r"the read sites differ"):
        convert.to_layer_layout(steps, layers=1)


# -- a model and its optimisers, round trip -------------------------------------------------------
ROUND_TRIP = [("baseline", "sites")] + [
    (v, layout) for v in ("attnres", "sliced", "projected") for layout in ("sites", "bank", "pairs")
]


def _step(model, opt, tokens) -> None:
    loss = cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    "variant, layout", ROUND_TRIP, ids=[f"{v}-{layout}" for v, layout in ROUND_TRIP]
)
def test_old_model_and_optimizer_state_convert_to_the_same_model(build, variant, layout):
    """A model and its Muon + AdamW state in an old layout, converted: the same state dicts,
    outputs equal bit for bit in a model built apart, and the next optimiser step the same."""
    kw = dict(variant=variant, blocks=2, rank=16)
    recipe = recipe_param_groups(variant, implementation="for-loop", ortho_dtype="float32")
    model = build(seed=0, **kw)
    opt = recipe.build(model_parts=[model])
    tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(0))
    _step(model, opt, tokens)
    # copies: an optimiser's state dict holds its live tensors, which load_state_dict may keep
    state = copy.deepcopy({**model.state_dict(), "optimizer": opt.state_dict()})

    old = to_old_layout(state, layout)
    assert convert.is_old_layout(old) and not convert.is_old_layout(state)
    r = 64 if variant == "attnres" else 16
    if layout == "pairs":
        assert [old[f"layers.{i}.queries"].shape for i in range(LAYERS)] == [(2, r)] * LAYERS
        assert "state.layers.1.queries.exp_avg" in old["optimizer"]
    else:
        assert "layers.3.feed_forward.w2.weight" in old
    if variant != "baseline" and layout != "pairs":
        name = convert.OLD if layout == "bank" else "router.query_4"
        assert old[name].shape == ((2 * LAYERS, r) if layout == "bank" else (r,))
        assert f"state.{name}.exp_avg" in old["optimizer"]
    if variant == "projected" and layout != "pairs":
        assert "router.embedding_key.weight" in old

    new = convert.to_layer_layout(old)
    assert _equal(new, state)
    fresh = build(seed=1, **kw)
    fresh.load_state_dict({k: v for k, v in new.items() if k != "optimizer"}, strict=True)
    fresh_opt = recipe.build(model_parts=[fresh])
    fresh_opt.load_state_dict(new["optimizer"])
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))
    _step(model, opt, tokens)
    _step(fresh, fresh_opt, tokens)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name


# -- a real run's checkpoint ----------------------------------------------------------------------
def _to_old_folder(src: Path, dst: Path, layout: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = dst.parent / "flat.pt"
        dcp_to_torch_save(str(src), str(flat))
        torch.save(to_old_layout(torch.load(flat, weights_only=False), layout), flat)
        torch_save_to_dcp(str(flat), str(dst))
        flat.unlink()
    integrity.record(dst)


def _flat(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = folder.parent / f"{folder.name}.pt"
        dcp_to_torch_save(str(folder), str(flat))
        state = torch.load(flat, weights_only=False)
        flat.unlink()
    return state


def _stored(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def _run(name: str, folder: Path, args: list[str]) -> dict:
    return {"name": name, "argv": ["cpu_smoke", "--dump_folder", str(folder), *args]}


def _run_folder(full: Path, folder: Path, layout: str) -> Path:
    """A run folder holding ``full``'s step-2 checkpoint in an old layout; returns the step."""
    (folder / "checkpoint").mkdir(parents=True)
    shutil.copy(full / "checkpoint" / "model_fingerprint.json", folder / "checkpoint")
    step2 = folder / "checkpoint" / "step-2"
    _to_old_folder(full / "checkpoint" / "step-2", step2, layout)
    return step2


def test_old_checkpoint_refused_converted_and_resumed(env, tmp_path):
    common = ["--training.steps", "4", "--checkpoint.interval", "2", "--validator.no-enable"]
    common += ["--debug.seed", "0", "--debug.deterministic"]
    full = tmp_path / "full"
    runs, _ = launch([_run("full", full, common)], tmp_path / "l1", env)
    assert runs["full"]["rc"] == 0, runs["full"]["output"][-3000:]
    want = full / "checkpoint" / "step-2"

    # the same run stopped after step 2, its checkpoint in each earlier layout, and one (pairs:
    # told by shape alone) left so
    layouts = {"sites": "sites", "bank": "bank", "pairs": "pairs", "refused": "pairs"}
    steps = {name: _run_folder(full, tmp_path / name, layout) for name, layout in layouts.items()}
    assert "router.query_3" in _stored(steps["sites"]) and convert.OLD in _stored(steps["bank"])
    assert not any("queries" in k for k in _stored(steps["sites"]) | _stored(steps["bank"]))
    assert _stored(steps["pairs"]) == _stored(want)  # the same names, other shapes
    for name in ("bank", "pairs"):
        with pytest.raises(convert.OldLayoutError, match=r"python -m titan_lrattnres.convert"):
            convert.refuse_old_layout(steps[name])

    for name in ("sites", "bank", "pairs"):
        cmd = [sys.executable, "-m", "titan_lrattnres.convert", str(tmp_path / name)]
        p = forkserver.run(cmd, env=env, cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"converted in place ({LAYERS} layers" in p.stdout
        assert (tmp_path / name / "checkpoint" / f"step-2{convert.BACKUP_SUFFIX}").is_dir()
        assert _stored(steps[name]) == _stored(want)
        integrity.check(steps[name])
        assert _equal(_flat(steps[name]), _flat(want))  # every entry, bitwise
        p = forkserver.run(cmd, env=env, cwd=ROOT, timeout=300)
        assert p.returncode == 0 and "already in the layer layout" in p.stdout

    runs, _ = launch(
        [_run(name, tmp_path / name, common) for name in ("refused", "sites", "bank", "pairs")],
        tmp_path / "l2",
        env,
    )
    refused = runs["refused"]
    assert refused["rc"] == 1
    (line,) = [x for x in refused["output"].splitlines() if x.startswith("error: ")]
    assert "earlier parameter layout ('layers.0.queries' has 2 rows" in line
    assert line.endswith(f"`python -m titan_lrattnres.convert {steps['refused']}`")
    history = json.loads((full / "loss_history.json").read_text())
    for name in ("sites", "bank", "pairs"):
        assert runs[name]["rc"] == 0, runs[name]["output"][-3000:]
        got = json.loads((tmp_path / name / "loss_history.json").read_text())
        assert [h["step"] for h in got] == [3, 4]
        assert [h["loss"] for h in got] == [h["loss"] for h in history[2:]]  # bitwise
