"""Checkpoints from before the layer layout (``titan_lrattnres.components.convert``).

Both old layouts -- per sublayer with one query per read site (``layers.{2i}.attention``,
``layers.{2i+1}.feed_forward``, ``router.query_<t> [r]``, ``router.embedding_key``) and the
older one-bank one (``router.query_bank [2L, r]``) -- are made from the layer layout by the
inverse mapping (:func:`to_old_layout`): of a model's and its optimisers' state, which converts
back into a model with the same outputs and optimisers that take the same next step; and of a
real run's step-2 checkpoint, which the trainer refuses by name with the command, and which
``python -m titan_lrattnres.convert`` turns into a folder from which training resumes with the
uninterrupted run's losses, bitwise."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.functional import cross_entropy

from tests.titan_lrattnres.trainer_runs import ROOT, launch
from titan_lrattnres.components import convert, integrity
from titan_lrattnres.components.optimizers import recipe_param_groups

LAYERS = 2  # the debug flavor (cpu_smoke)
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.(attention|feed_forward)(?=\.|$)")
_QUERIES = re.compile(r"(^|\.)layers\.(\d+)\.queries(?=\.|$)")
_KEY = re.compile(r"(^|\.)embedding_key(?=\.)")


def _old_name(key: str) -> str:
    def sublayer(m: re.Match) -> str:
        return f"{m[1]}layers.{2 * int(m[2]) + (m[3] == 'feed_forward')}.{m[3]}"

    return _KEY.sub(r"\1router.embedding_key", _LAYER.sub(sublayer, key))


def to_old_layout(state: dict, bank: bool = False) -> dict:
    """The inverse of ``convert.to_layer_layout``: ``state`` (nested or flat) in the per-sublayer
    layout, with per-site queries or (``bank``) the one-bank ``router.query_bank``."""
    out, banks = {}, {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = to_old_layout(value, bank)
            continue
        m = _QUERIES.search(key)
        if m is None:
            out[_old_name(key)] = value
            continue
        i, rows = int(m[2]), isinstance(value, torch.Tensor) and value.ndim >= 1
        prefix, suffix = _old_name(key[: m.start()]) + m[1], _old_name(key[m.end() :])
        if bank:
            banks.setdefault(prefix + convert.OLD + suffix, {})[i] = value
            continue
        for row in (0, 1):
            out[f"{prefix}router.query_{2 * i + 1 + row}{suffix}"] = value[row] if rows else value
    for key, by_layer in banks.items():
        assert sorted(by_layer) == list(range(LAYERS)), key
        first = by_layer[0]
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            out[key] = torch.cat([by_layer[i] for i in range(LAYERS)])
        else:
            out[key] = first
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
    assert torch.equal(out["layers.1.queries"], torch.stack([q[3], q[4]]))
    opt = out["optimizer"]
    assert torch.equal(opt["state.layers.0.queries.exp_avg"], -torch.stack([q[1], q[2]]))
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
    stored += [f"router.query_{t}" for t in range(1, 5)]
    own = ["layers.1.queries", "layers.0.feed_forward.w1.weight", "embedding_key.weight"]
    assert convert.source_keys(own, stored) == [
        "layers.1.feed_forward.w1.weight",
        "router.embedding_key.weight",
        "router.query_3",
        "router.query_4",
    ]
    bank = ["layers.3.feed_forward.w1.weight", convert.OLD]  # L = 2
    assert convert.source_keys(["layers.1.queries"], bank) == [convert.OLD]
    with pytest.raises(ValueError, match=r"layers.1.attention.wo.weight: sublayer 1 cannot hold"):
        convert.to_layer_layout({"layers.1.attention.wo.weight": 0})
    with pytest.raises(ValueError, match=r"layers.0.queries: needs both read sites"):
        convert.to_layer_layout({**dict.fromkeys(baseline, 0), "router.query_1": torch.ones(2)})
    with pytest.raises(ValueError, match=r"read site 5 is not in 1..4"):
        convert.to_layer_layout({"router.query_5": torch.ones(2)}, layers=2)
    with pytest.raises(ValueError, match=r"router.query_bank: \(6, 2\) has no 4 query rows"):
        convert.to_layer_layout({convert.OLD: torch.ones(6, 2)}, layers=2)
    steps = {f"state.router.query_{t}.step": torch.tensor(float(t)) for t in (1, 2)}
    with pytest.raises(ValueError, match=r"the two read sites differ"):
        convert.to_layer_layout(steps, layers=1)


# -- a model and its optimisers, round trip -------------------------------------------------------
ROUND_TRIP = [("baseline", False)] + [
    (v, bank) for v in ("attnres", "sliced", "projected") for bank in (False, True)
]


def _step(model, opt, tokens) -> None:
    loss = cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    "variant, bank", ROUND_TRIP, ids=[f"{v}{'-bank' * b}" for v, b in ROUND_TRIP]
)
def test_old_model_and_optimizer_state_convert_to_the_same_model(build, variant, bank):
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

    old = to_old_layout(state, bank)
    keys = [*old, *(f"optimizer.{k}" for k in old["optimizer"])]
    assert convert.is_old_layout(keys) and not convert.is_old_layout(state)
    assert "layers.3.feed_forward.w2.weight" in old
    if variant != "baseline":
        r = 64 if variant == "attnres" else 16
        name = convert.OLD if bank else "router.query_4"
        assert old[name].shape == ((2 * LAYERS, r) if bank else (r,))
        assert f"state.{name}.exp_avg" in old["optimizer"]
    if variant == "projected":
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
def _to_old_folder(src: Path, dst: Path, bank: bool) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = dst.parent / "flat.pt"
        dcp_to_torch_save(str(src), str(flat))
        torch.save(to_old_layout(torch.load(flat, weights_only=False), bank), flat)
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


def _run_folder(full: Path, folder: Path, bank: bool) -> Path:
    """A run folder holding ``full``'s step-2 checkpoint in an old layout; returns the step."""
    (folder / "checkpoint").mkdir(parents=True)
    shutil.copy(full / "checkpoint" / "model_fingerprint.json", folder / "checkpoint")
    step2 = folder / "checkpoint" / "step-2"
    _to_old_folder(full / "checkpoint" / "step-2", step2, bank)
    return step2


def test_old_checkpoint_refused_converted_and_resumed(env, tmp_path):
    common = ["--training.steps", "4", "--checkpoint.interval", "2", "--validator.no-enable"]
    common += ["--debug.seed", "0", "--debug.deterministic"]
    full = tmp_path / "full"
    runs, _ = launch([_run("full", full, common)], tmp_path / "l1", env)
    assert runs["full"]["rc"] == 0, runs["full"]["output"][-3000:]
    want = full / "checkpoint" / "step-2"

    # the same run stopped after step 2, its checkpoint in either old layout, and one left so
    layouts = {"sites": False, "bank": True, "refused": False}
    steps = {name: _run_folder(full, tmp_path / name, bank) for name, bank in layouts.items()}
    assert "router.query_3" in _stored(steps["sites"]) and convert.OLD in _stored(steps["bank"])
    assert not any("queries" in k for k in _stored(steps["sites"]) | _stored(steps["bank"]))
    with pytest.raises(convert.OldLayoutError, match=r"python -m titan_lrattnres.convert"):
        convert.refuse_old_layout(steps["bank"])

    for name in ("sites", "bank"):
        cmd = [sys.executable, "-m", "titan_lrattnres.convert", str(tmp_path / name)]
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"converted in place ({LAYERS} layers" in p.stdout
        assert (tmp_path / name / "checkpoint" / f"step-2{convert.BACKUP_SUFFIX}").is_dir()
        assert _stored(steps[name]) == _stored(want)
        integrity.check(steps[name])
        assert _equal(_flat(steps[name]), _flat(want))  # every entry, bitwise
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "already in the layer layout" in p.stdout

    runs, _ = launch(
        [_run(name, tmp_path / name, common) for name in ("refused", "sites", "bank")],
        tmp_path / "l2",
        env,
    )
    refused = runs["refused"]
    assert refused["rc"] == 1
    (line,) = [x for x in refused["output"].splitlines() if x.startswith("error: ")]
    assert "old per-sublayer layout" in line
    assert line.endswith(f"`python -m titan_lrattnres.convert {steps['refused']}`")
    history = json.loads((full / "loss_history.json").read_text())
    for name in ("sites", "bank"):
        assert runs[name]["rc"] == 0, runs[name]["output"][-3000:]
        got = json.loads((tmp_path / name / "loss_history.json").read_text())
        assert [h["step"] for h in got] == [3, 4]
        assert [h["loss"] for h in got] == [h["loss"] for h in history[2:]]  # bitwise
