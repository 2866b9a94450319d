"""torchtitan's per-layer compile at the paper's depth: zero graph breaks, no recompiles.

Compiles every entry of ``model.layers`` with ``fullgraph=True`` exactly as torchtitan's
``apply_compile`` does, on a 24-layer model; and several models in one process. Graph breaks,
recompiles, the recompile limit and the graph count are dynamo's, so these tests compile with
dynamo's ``eager`` backend (the captured graphs run as they are); what AOTAutograd and Inductor
make of a layer's graph is tested in ``test_backends.py``.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torchtitan.config import CompileConfig
from torchtitan.distributed.compile import apply_compile

from titan_lrattnres.parallel.compile import compile_layers


class _Dims:  # the two attributes apply_compile reads from ParallelDims
    tp_enabled = False


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize(
    "variant,blocks,backend",
    [
        ("projected", None, "auto"),
        ("baseline", None, "reference"),
    ],
)
def test_24_layers_compile_without_breaks_or_recompiles(build, variant, blocks, backend):
    model = build("deep_debug", variant=variant, blocks=blocks, rank=16, depth_backend=backend)
    eager = build("deep_debug", variant=variant, blocks=blocks, rank=16, depth_backend=backend)
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    apply_compile(
        model, compile_config=CompileConfig(enable=True, backend="eager"), parallel_dims=_Dims
    )
    for _ in range(3):
        model.zero_grad()
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
    ref = eager(tokens).float().logsumexp(-1).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 1  # the counters do see the compiled units
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    # one graph per distinct layer plan (completed sources in, a partial in, block ends, first,
    # last), shared by every layer with that plan; the baseline's 24 layers share one
    plans = set(map(_plan(blocks), range(24)))
    assert counters["stats"]["unique_graphs"] == (1 if variant == "baseline" else len(plans))
    assert not counters["recompiles"], dict(counters["recompiles"])
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))


def _plan(blocks):
    """Layer i's plan of a 24-layer model, from docs/method.md §3's block ends."""
    n = 48 if blocks is None else blocks
    ends = {-(-48 * k // n) for k in range(1, n + 1)}

    def plan(i):
        sources = 1 + sum(1 for e in ends if e <= 2 * i)
        partial_in = i > 0 and 2 * i not in ends
        return sources, partial_in, (2 * i + 1 in ends, 2 * i + 2 in ends), i == 0, i == 23

    return plan


@pytest.mark.parametrize("ac", ["selective"])
def test_several_models_compile_in_one_process(build, ac):
    """Models of different variants and sizes, each built and compiled as torchtitan does,
    train side by side in one process: no graph breaks, no recompiles, no recompile limit."""
    from titan_lrattnres.evaluation.memory import apply_ac
    from titan_lrattnres.model.registry import Flavor

    small = Flavor(dim=32, n_layers=6, n_heads=2, hidden_dim=64, vocab_size=256, max_seq_len=64)
    wide = Flavor(dim=64, n_layers=6, n_heads=4, hidden_dim=96, vocab_size=256, max_seq_len=64)
    configs = [
        (small, dict(variant="sliced", blocks=4, rank=8)),
        (small, dict(variant="projected", blocks=4, rank=8)),
        (wide, dict(variant="sliced", blocks=4, rank=8)),
        (small, dict(variant="attnres", blocks=None)),
        (wide, dict(variant="projected", blocks=None, rank=16)),
        (small, dict(variant="baseline")),
    ]
    models = []
    for flavor, kw in configs:
        model = build(flavor, depth_backend="auto", **kw)
        if ac is not None:
            apply_ac(model, ac)
        compile_layers(model, CompileConfig(enable=True, backend="eager"), _Dims)
        models.append(model)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        for model in models:
            model(tokens).float().logsumexp(-1).mean().backward()
        if step == 0:  # every model's graphs made; a layer plan two sizes share has two
            graphs = counters["stats"]["unique_graphs"]
            counters["recompiles"].clear()
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs  # steps 2 and 3 reuse them all
    assert not counters["recompiles"], dict(counters["recompiles"])
    for model in models:
        assert all(p.grad is not None for p in model.parameters())
