"""Hugging Face format (``--format hf``): the transformers port against the project's model.

Logits of every variant x schedule, KV-cached decoding, greedy ``generate()``, left padding, bf16
loading, the remote code's copy of the read maths against ``custom_ops.reference``, and the
DCP -> CLI -> ``from_pretrained(trust_remote_code=True)`` path in a process that cannot import
this project."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache

from custom_ops import reference
from custom_ops.schedule import schedule_ends
from tests.titan_lrattnres._tiny import trained
from titan_lrattnres.components.data import train_tokenizer
from titan_lrattnres.evaluation import generate as gen
from titan_lrattnres.evaluation.hf import (
    LRAttnResConfig,
    LRAttnResForCausalLM,
    LRAttnResModel,
    configuration_lrattnres,
    export_hf,
    modeling_lrattnres,
    to_hf,
)
from titan_lrattnres.evaluation.inference import build_model
from titan_lrattnres.model.registry import Flavor

ROOT = Path(__file__).resolve().parents[3]
V = 300  # not a multiple of 64: the checkpoint has 320 rows, the HF model 300
# L = 3: blocks=2 puts a boundary between a layer's attention and its MLP, block_layers=2 leaves
# a partial last block
FLAVOR = Flavor(dim=64, n_layers=3, n_heads=4, hidden_dim=192, vocab_size=V, max_seq_len=512)
CONFIGS = [
    pytest.param("baseline", {}, id="baseline"),
    pytest.param("attnres", {"blocks": None}, id="attnres-full"),
    pytest.param("attnres", {"blocks": 2}, id="attnres-block2"),
    pytest.param("sliced", {"blocks": None}, id="sliced-full"),
    pytest.param("sliced", {"blocks": 2}, id="sliced-block2"),
    pytest.param("projected", {"blocks": None}, id="projected-full"),
    pytest.param("projected", {"blocks": 2}, id="projected-block2"),
    pytest.param("sliced", {"block_layers": 2}, id="sliced-block_layers2"),
    pytest.param("projected", {"block_layers": 2}, id="projected-block_layers2"),
]
TEXT = "def add(a, b):\n    return a + b\n"


def _model(variant, schedule, seed=0):
    """The project's model (reference depth path) with random, non-zero depth queries."""
    torch.manual_seed(seed)
    args = dict(flavor=FLAVOR, variant=variant, rank=16, **schedule)
    model = build_model(args, depth_backend="reference")
    with torch.no_grad():
        for q in model.depth_queries():
            q.normal_(0, 1.5 / q.shape[-1] ** 0.5)
    return model


def _trained(variant, blocks, steps=3):
    """A ``debug`` model (JSON-able args, V=300) trained a few AdamW steps on random tokens."""
    return trained(variant, blocks, steps=steps, vocab_size=V)


def _tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer (the corpus tokenizer's kind) with < V ids."""
    texts = [TEXT, "for i in range(10):\n    print(i)\n", "import os\nimport sys\n"] * 20
    tok = train_tokenizer(texts, vocab_size=280)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("variant,schedule", CONFIGS)
def test_logits_and_cached_decoding_match_project_model(variant, schedule):
    model = _model(variant, schedule)
    hf = to_hf(model)
    assert hf.config.vocab_size == V and hf.lm_head.weight.shape[0] == V
    x = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        want = model(x)[..., :V]
        torch.testing.assert_close(hf(x).logits, want, rtol=0, atol=1e-5)
        # prefill 6, a chunk of 3, then one token at a time through a DynamicCache
        cache, got = DynamicCache(config=hf.config), []
        for a, b in [(0, 6), (6, 9), *((i, i + 1) for i in range(9, 13))]:
            got.append(hf(x[:, a:b], cache=cache, use_cache=True).logits)
        assert cache.get_seq_length() == 13 and len(cache) == FLAVOR.n_layers
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant,schedule", CONFIGS)
def test_greedy_generate_matches_project_generate(variant, schedule):
    model = _model(variant, schedule, seed=1)
    hf = to_hf(model)
    prompt = torch.randint(0, V, (1, 5))
    want = gen.generate(model, prompt, 12)
    got = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_left_padded_batch_equals_rows_alone(attn):
    hf = to_hf(_model("projected", {"blocks": 2}))
    hf.set_attn_implementation(attn)
    assert hf.config._attn_implementation == attn
    rows = [torch.randint(1, V, (n,)) for n in (7, 4, 2)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    with torch.no_grad():
        batch = hf(ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            alone = hf(r[None]).logits[0]
            torch.testing.assert_close(batch[i, width - len(r) :], alone, rtol=0, atol=1e-5)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, r in enumerate(rows):
        alone = hf.generate(r[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out[i, width - len(r) :], alone[0])


def test_saved_folder_round_trip_registered_classes_and_bf16(tmp_path):
    """In-package (registered) classes: ``from_pretrained`` without remote code; bf16 loading
    keeps the depth queries fp32."""
    model = _model("projected", {"blocks": 2})
    tok = _tokenizer(tmp_path / "tok")
    record = export_hf(model, tmp_path / "hf", tokenizer=tok)
    eot = record["eos_token_id"]
    assert eot is not None and record["vocab_size"] == V
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "lrattnres" and config["tie_word_embeddings"] is False
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eot
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "hf"), LRAttnResConfig)
    assert isinstance(AutoModel.from_pretrained(tmp_path / "hf"), LRAttnResModel)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded) is LRAttnResForCausalLM
    for k, v in to_hf(model).state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        want = model(x)[..., :V]
        loss = torch.nn.functional.cross_entropy(want[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        torch.testing.assert_close(loaded(x, labels=x).loss, loss, rtol=1e-5, atol=1e-6)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert bf16.model.router.queries.dtype == torch.float32
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].self_attn.depth_key_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = bf16(x).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05)


# -- the remote code --------------------------------------------------------------------------
def test_remote_code_imports_only_torch_and_transformers():
    for module in (configuration_lrattnres, modeling_lrattnres):
        tree = ast.parse(Path(module.__file__).read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots.add("." * node.level + (node.module or "").split(".")[0])
        assert roots <= {"__future__", "torch", "transformers", ".configuration_lrattnres"}, roots


@settings(deadline=None, max_examples=40)
@given(
    sources=st.integers(1, 6),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    d=st.integers(1, 24),
    rank=st.integers(1, 24),
    projected=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    log_scale=st.integers(-20, 20),
    eps=st.sampled_from([None, 1e-6]),
    seed=st.integers(0, 2**16),
)
def test_depth_read_copy_matches_reference(
    sources, lead, d, rank, projected, dtype, log_scale, eps, seed
):
    rank = min(rank, d)
    g = torch.Generator().manual_seed(seed)
    values = [
        (torch.randn(*lead, d, generator=g) * 2.0**log_scale).to(dtype) for _ in range(sources)
    ]
    if projected:
        keys = [torch.randn(*lead, rank, generator=g) * 2.0**log_scale for _ in range(sources)]
    else:
        keys = reference.sliced_keys(values, rank)
    query = torch.randn(rank, generator=g)
    for k in keys:
        torch.testing.assert_close(
            modeling_lrattnres.key_rmsnorm(k, eps), reference.key_rmsnorm(k, eps), rtol=0, atol=0
        )
    got = modeling_lrattnres.depth_read(values, keys, query, eps)
    assert got.dtype == dtype
    torch.testing.assert_close(got, reference.depth_read(values, keys, query, eps), rtol=0, atol=0)


def test_schedule_copy_matches_custom_ops():
    for m in range(2, 25, 2):
        assert modeling_lrattnres.schedule_ends(m) == schedule_ends(m)
        for n in range(1, m + 1):
            assert modeling_lrattnres.schedule_ends(m, n) == schedule_ends(m, n)
        for k in range(1, m // 2 + 1):
            assert modeling_lrattnres.schedule_ends(m, None, k) == schedule_ends(m, None, k)


# -- DCP checkpoint -> CLI -> a process without this project -------------------------------------
LOADER = """
import importlib.abc, sys, torch

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"titan_lrattnres", "custom_ops", "torchtitan"}:
            raise ImportError(f"the exported folder imported {name}")

sys.meta_path.insert(0, Block())
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

folder, data, text = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
base = AutoModel.from_pretrained(folder, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
x = torch.load(data)
with torch.no_grad():
    out = {
        "modules": [type(model).__module__, type(base).__module__,
                    type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__module__],
        "logits": model(x).logits,
        "hidden": base(x).last_hidden_state,
        "generated": model.generate(x[:1, :5], max_new_tokens=10, do_sample=False),
        "ids": tok(text).input_ids,
        "eos": model.generation_config.eos_token_id,
        "pad_side": tok.padding_side,
    }
torch.save(out, data + ".out")
"""


def test_cli_dcp_to_hf_loads_with_remote_code_only(tmp_path):
    model, args = _trained("projected", 2)
    run = tmp_path / "run"
    dcp.save(model.state_dict(), checkpoint_id=str(run / "checkpoint" / "step-3"))
    (run / "model_args.json").write_text(json.dumps(args))
    tokenizer = _tokenizer(run)  # beside the checkpoint: found by the CLI
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
    )
    cmd = [sys.executable, "-m", "titan_lrattnres.export", "--run", str(run)]
    out = tmp_path / "out"
    subprocess.run([*cmd, "--out", str(out), "--format", "hf"], check=True, env=env, timeout=600)
    record = json.loads((out / "export.json").read_text())
    assert record["files"] == {"hf": "hf"} and record["hf"]["tokenizer"] == str(tokenizer)
    x = torch.randint(0, V, (2, 11))
    torch.save(x, tmp_path / "x.pt")
    blocked = dict(env, PYTHONPATH="", PYTHONNOUSERSITE="1")
    subprocess.run(
        [sys.executable, "-c", LOADER, str(out / "hf"), str(tmp_path / "x.pt"), TEXT],
        check=True,
        env=blocked,
        cwd=tmp_path,
        timeout=600,
    )
    got = torch.load(tmp_path / "x.pt.out")
    assert all(m.startswith("transformers_modules") for m in got["modules"]), got["modules"]
    with torch.no_grad():
        want = model(x)[..., :V]
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5)
    assert got["hidden"].shape == (2, 11, 64)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id("<|endoftext|>")
    assert got["eos"] == eot and got["pad_side"] == "left"
    assert got["ids"] == tok.encode(TEXT).ids
    assert torch.equal(got["generated"], gen.generate(model, x[:1, :5], 10, eos_id=eot))


def test_tokenizer_larger_than_vocabulary_is_refused(tmp_path):
    model = build_model(dict(flavor="debug", variant="sliced", blocks=2, rank=16, vocab_size=256))
    with pytest.raises(ValueError, match="tokenizer has"):
        export_hf(model, tmp_path / "hf", tokenizer=_tokenizer(tmp_path))
