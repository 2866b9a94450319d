"""Context parallel (``titan_lrattnres.parallel.context``): the config checks and the layouts CP
relies on (fast), the CPU stand-in for FlexAttention against SDPA (fast), and CP=2 against one
process on CPU over gloo (slow).

The slow test is ``benchmarks.gpu_cp``'s dry run: torchtitan's own CP machinery (load-balanced
sharding of tokens, labels, positions and the FlexAttention ``BlockMask``; keys and values
all-gathered over CP with their gradients reduce-scattered back; FSDP2 over ``dp_shard`` x ``cp``)
on the project's model, with ``DenseFlexAttention`` as the kernel, against one process on the
whole sequence from the same weights: loss and every parameter's gradient within
``gpu_cp.TOL["cpu"]`` = 1e-5 relative (measured at T=256: loss <= 1.2e-7, gradients <= 1.2e-6,
a layer's queries the largest: the ranks' partial gradients are summed in another order).
"""

from __future__ import annotations

import json

import pytest
import spmd_types as spmd
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.distributed.parallel_dims import MeshAxisName

from benchmarks import gpu_cp
from titan_lrattnres.parallel.context import DenseFlexAttention
from titan_lrattnres.spec import model_registry

CP, TP = MeshAxisName.CP, MeshAxisName.TP


def _config(attn_backend: str, variant: str = "projected", **parallelism):
    from train_configs.cpu import cpu_smoke

    c = cpu_smoke()
    c.model_spec = model_registry(
        "debug", variant=variant, blocks=2, rank=16, attn_backend=attn_backend
    )
    c.parallelism.context_parallel_degree = 2
    for k, v in parallelism.items():
        setattr(c.parallelism, k, v)
    return c


# -- fast ---------------------------------------------------------------------------------------
def test_cp_refuses_sdpa_with_the_reason():
    c = _config("sdpa")
    with pytest.raises(NotImplementedError, match=r"needs attn_backend='flex' \(got Scaled"):
        c.model_spec.model.update_from_config(config=c)


def test_cp_refuses_the_partial_dtensor_backend():
    c = _config("flex", spmd_backend="partial_dtensor")
    with pytest.raises(
        NotImplementedError, match="not checked with parallelism.spmd_backend='partial_dtensor'"
    ):
        c.model_spec.model.update_from_config(config=c)


@pytest.mark.parametrize("sp", [False, True])
def test_cp_layouts(sp):
    """What CP relies on: the depth parameters (each layer's queries, the embedding key)
    replicated on CP (FSDP2 over dp_shard x cp
    sums their gradients), every attention's keys and values gathered over CP with their
    gradients partial (reduce-scattered back to their owners), queries left sequence-sharded."""
    c = _config("flex", tensor_parallel_degree=2 if sp else 1, enable_sequence_parallel=sp)
    m = c.model_spec.model
    m.update_from_config(config=c)
    queries = [(layer, "queries") for layer in m.layers]
    for cfg, name in (*queries, (m.embedding_key, "weight")):
        layout = cfg.sharding_config.state_shardings[name]
        assert layout.axis_types[CP] is spmd.R
        assert layout.axis_types[TP] is (spmd.R if sp else spmd.I)
    attentions = [layer.attention for layer in m.layers if layer.attention is not None]
    assert len(attentions) == 2
    for attention in attentions:
        s = attention.inner_attention.sharding_config
        assert s.in_dst_shardings["q_BLNH"].axis_types[CP] == spmd.S(1)
        for kv in ("k_BLNH", "v_BLNH"):
            assert s.in_src_shardings[kv].axis_types[CP] == spmd.S(1)
            assert s.in_dst_shardings[kv].axis_types[CP] is spmd.R
        q_grad, k_grad, v_grad = s.local_map.in_grad_placements
        assert k_grad.axis_types[CP] is spmd.P and v_grad.axis_types[CP] is spmd.P


def test_dense_flex_attention_equals_sdpa():
    """With a causal BlockMask: SDPA's causal attention, output and q/k/v gradients within 1e-5
    relative (measured <= 2.7e-7: SDPA's causal CPU kernel sums in another order)."""
    torch.manual_seed(0)
    b, t, n, h = 2, 96, 4, 16
    q, k, v = (torch.randn(b, t, n, h, requires_grad=True) for _ in range(3))
    mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, b, None, t, t, device="cpu")
    attention = DenseFlexAttention.Config().build()
    out = attention(q, k, v, attention_masks=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert (got - want).norm() <= 1e-5 * want.norm()
    with pytest.raises(ValueError, match=r"BlockMask is for \(q, kv\) lengths \(96, 96\)"):
        attention(q, k[:, :64], v[:, :64], attention_masks=mask)


def test_gpu_cp_without_two_gpus_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_cp.torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "cp.json"
    assert gpu_cp.main(["--out", str(out)]) == 0
    assert "needs 2 GPUs, found 1" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["skipped"] == "needs 2 GPUs, found 1" and r["dry_run"] is False


# -- slow: 2 gloo ranks -------------------------------------------------------------------------
@pytest.mark.slow
def test_cp2_equals_one_process():
    """Every case of ``benchmarks.gpu_cp`` (S-LR Block, P-LR Block, S-LR Full over packed
    documents): loss and every parameter's gradient, against one process (~30 s on 2 cores)."""
    r = gpu_cp.run(dry_run=True, seq_len=256, cases=list(gpu_cp.CASES))
    assert r["device"] == "cpu" and set(r["results"]) == set(gpu_cp.CASES)
    tol = gpu_cp.TOL["cpu"]
    for case, res in r["results"].items():
        assert "error" not in res, (case, res.get("traceback"))
        layers = {f"layers.{i}.{w}.weight" for i in (0, 1) for w in ("attention.wo",
                  "attention.qkv_linear.wqkv")}  # fmt: skip
        layers |= {f"layers.{i}.feed_forward.w{j}.weight" for i in (0, 1) for j in (1, 2, 3)}
        want = {"tok_embeddings.weight", "lm_head.weight", *layers}
        want |= {f"layers.{i}.queries" for i in (0, 1)}
        if case.startswith("projected"):
            want.add("embedding_key.weight")
        assert set(res["grad_rel_err"]) == want, case
        assert all(n > 0 for n in res["ref_grad_norm"].values()), case
        assert res["loss_rel_err"] <= tol, (case, res["loss_rel_err"])
        worst = max(res["grad_rel_err"], key=res["grad_rel_err"].get)
        assert res["grad_rel_err"][worst] <= tol, (case, worst, res["grad_rel_err"][worst])
        assert res["ok"]
        if "documents" not in case:  # positions = token indices: the load-balanced order
            assert res["chunk_first_positions"] == [[0, 192], [64, 128]], case
    assert r["all_ok"]
