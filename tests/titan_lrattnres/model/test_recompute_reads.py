"""``recompute_reads`` (on with activation checkpointing): every read is recomputed in the
backward and keeps only its inputs (the sources and the partial, which later reads keep anyway),
and the sublayer reading h keeps no copy of it: its backward rebuilds h from the read's inputs.

Held to the plain model (no AC, nothing recomputed) under torchtitan's full and selective AC
applied to ``model.layers`` as the trainer applies them, eager and compiled per sublayer: the
loss and every gradient, and no h alive after the forward; in bytes, the forward leaves for the
backward what the baseline's does, plus one ``[T, d]`` and (projected) the fp32 keys."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from titan_lrattnres.model import depth
from titan_lrattnres.model.registry import Flavor, build_model_config

# 8 sublayers; Block N=2 has ends at 4 and 8, so both merge sites and block-end sites recompute
FLAVOR = Flavor(dim=32, n_layers=4, n_heads=2, hidden_dim=64, vocab_size=256, max_seq_len=32)
RANK = 8
AC = {"full": FullAC, "selective": SelectiveAC}  # as the trainer builds them from its config


def _model(variant, blocks, ac=None, *, backend="auto", flavor=FLAVOR):
    """The model as the trainer wires it: ``recompute_reads`` with AC (the model config's), the
    AC policy applied as ``parallelize_llama`` does; non-zero queries (the weights use them)."""
    config = build_model_config(flavor, variant=variant, blocks=blocks, rank=RANK,
                                depth_backend=backend, attn_backend="sdpa")  # fmt: skip
    config.router.recompute_reads = ac is not None
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        for q in model.router.query_params():
            q.normal_(0, 1.5 / q.shape[-1] ** 0.5)
    if ac is not None:
        AC[ac].Config().build().apply(model)
    return model


def _tokens(flavor=FLAVOR, batch=2, seq=24):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, flavor.vocab_size, (batch, seq), generator=g)


def _loss(model, tokens):
    return model(tokens).float().logsumexp(-1).mean()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad
            for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip


def _bytes(ref: StorageWeakRef) -> int:
    """The bytes a storage holds now: 0 once freed, or given back while its tensors live."""
    return 0 if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


def _h_storages(model) -> list[StorageWeakRef]:
    """Records the storage of every h the router returns (sites 1..M) from now on."""
    seen, step = [], model.router.step

    def recording_step(*args):  # h, or the phase-1 read a sublayer finishes (Block: a view)
        h, read = step(*args)
        seen.append(StorageWeakRef(h.untyped_storage()))
        return h, read

    model.router.step = recording_step
    return seen


def _assert_same(ref_model, loss0, model, loss1):
    assert torch.equal(loss0, loss1)  # the same reads, recomputed or not
    want, got = _grads(ref_model), _grads(model)
    assert got.keys() == want.keys()
    for name, g in want.items():  # fp32; the sources' gradients summed in another order
        err = ((g - got[name]).norm() / g.norm().clamp_min(1e-30)).item()
        assert err < TOLERANCE, (name, err)


TOLERANCE = 2e-6  # relative norm; measured: at most 5.2e-7 (a query's), 0 for most parameters

CASES = [  # (variant, blocks): Block N=2 and Full
    ("sliced", 2),
    ("projected", 2),
    ("attnres", 2),
    ("sliced", None),
    ("projected", None),
    ("attnres", None),
]


@pytest.mark.parametrize("ac", sorted(AC))
@pytest.mark.parametrize("variant, blocks", CASES)
def test_same_loss_and_gradients_and_no_h_kept(variant, blocks, ac):
    tokens = _tokens()
    ref = _model(variant, blocks)
    loss0 = _loss(ref, tokens)
    loss0.backward()
    model = _model(variant, blocks, ac)
    hs = _h_storages(model)
    loss1 = _loss(model, tokens)
    assert len(hs) == 2 * FLAVOR.n_layers
    # every h but the last (the final norm's input) holds no memory after the forward
    assert [_bytes(s) for s in hs[:-1]] == [0] * (len(hs) - 1)
    loss1.backward()
    _assert_same(ref, loss0, model, loss1)


@pytest.mark.parametrize("ac", sorted(AC))
@pytest.mark.parametrize("variant, blocks", CASES)
def test_a_given_back_read_is_filled_again_before_a_sublayer_reading_it_runs_its_backward(
    variant, blocks, ac
):
    """The next read's backward fills a given-back read again (``depth._GivenBack``), which
    holds only if it runs before the backward of every sublayer reading that read: at each such
    sublayer's output node, the read's storages hold their bytes again. (A sublayer reading a
    freed storage would read freed memory.)"""
    model = _model(variant, blocks, ac)
    readers, start, run = [], model.router.start, model.run_depth
    states = []

    def starting(embedding):
        states.append(start(embedding))
        return states[-1]

    def recording(embedding, fn, on_read=None):
        def call(j, layer, h, read):
            out = fn(j, layer, h, read)
            given = states[-1].recomputed  # the read this sublayer's input came from
            if given is not None:
                node = (out[0] if isinstance(out, tuple) else out).grad_fn
                readers.append(([StorageWeakRef(t.untyped_storage()) for t in given.outputs], node))
            return out

        return run(embedding, call, on_read)

    model.router.start, model.run_depth = starting, recording
    loss = _loss(model, _tokens())
    # every sublayer reads a read made under AC, given back once the next read was made
    assert len(readers) == 2 * FLAVOR.n_layers
    assert all(_bytes(s) == 0 for storages, _ in readers for s in storages)
    checked = []

    def filled(storages):  # raised here, the backward stops before the sublayer's would run
        assert all(map(_bytes, storages)), "a sublayer's backward reads a given-back read"
        checked.append(storages)

    for storages, node in readers:
        node.register_prehook(lambda grads, s=storages: filled(s))
    loss.backward()
    assert len(checked) == len(readers)


@pytest.mark.parametrize("ac", sorted(AC))
@pytest.mark.parametrize("variant, blocks", [("sliced", 2), ("projected", None)])
def test_a_partial_backward_the_same(variant, blocks, ac):
    """What the reads made, given back after the forward, is there again for a backward that
    runs only the nodes on the way to the first sublayer's parameters (``autograd.grad``)."""
    tokens = _tokens()
    ref, model = _model(variant, blocks), _model(variant, blocks, ac)
    params = [list(m.layers["0"].parameters()) for m in (ref, model)]
    want = torch.autograd.grad(_loss(ref, tokens), params[0])
    got = torch.autograd.grad(_loss(model, tokens), params[1])
    for w, g in zip(want, got, strict=True):
        assert ((w - g).norm() / w.norm()).item() < TOLERANCE


@pytest.mark.parametrize("variant, blocks", [("sliced", 2), ("projected", None)])
def test_a_retained_graph_under_full_ac_adds_the_same_again(variant, blocks):
    """The refilled storages stay for a retained graph's second backward (full AC; selective
    AC refuses a second backward of its regions by design)."""
    tokens = _tokens()
    model = _model(variant, blocks, "full")
    loss = _loss(model, tokens)
    loss.backward(retain_graph=True)
    once = {name: g.clone() for name, g in _grads(model).items()}
    loss.backward()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, 2 * once[name], rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("ac", sorted(AC))
def test_compiled_sublayers_the_same(ac):
    """torchtitan's per-sublayer compile over the AC wrappers (its order): the compiled
    function's save of h is dropped as the eager checkpoint's is; one graph per sublayer kind."""
    from torch._dynamo.utils import counters
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    class Dims:  # what apply_compile reads from ParallelDims
        tp_enabled = False

    tokens = _tokens()
    ref = _model("projected", 2)
    loss0 = _loss(ref, tokens)
    loss0.backward()
    torch._dynamo.reset()
    counters.clear()
    try:
        model = _model("projected", 2, ac)
        config = CompileConfig(enable=True, backend="aot_eager")
        apply_compile(model, compile_config=config, parallel_dims=Dims)
        hs = _h_storages(model)
        loss1 = _loss(model, tokens)
        assert [_bytes(s) for s in hs[:-1]] == [0] * (len(hs) - 1)
        loss1.backward()
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
        # per sublayer kind (attention, MLP) and input form (h, or a read to finish)
        assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
        assert not counters["recompiles"], dict(counters["recompiles"])
    finally:
        torch._dynamo.reset()
    _assert_same(ref, loss0, model, loss1)


def test_under_fsdp2_the_same():
    """FSDP2 over the AC wrappers as torchtitan applies it (one gloo rank): its pre-forward hands
    each sublayer its input through an autograd function, a new tensor on h's storage; that
    alias is dropped too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    tokens = _tokens()
    ref = _model("sliced", 2)
    loss0 = _loss(ref, tokens)
    loss0.backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model("sliced", 2, "full")
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                              pp_enabled=False, cpu_offload=False,
                              reshard_after_forward_policy="default")  # fmt: skip
        hs = _h_storages(model)
        loss1 = _loss(model, tokens)
        assert [_bytes(s) for s in hs[:-1]] == [0] * (len(hs) - 1)
        loss1.backward()
        for p in model.parameters():
            p.grad = p.grad.full_tensor()
    finally:
        dist.destroy_process_group()
    _assert_same(ref, loss0, model, loss1)


def test_reference_backend_and_no_grad_the_same():
    tokens = _tokens()
    ref = _model("projected", 2, backend="reference")
    loss0 = _loss(ref, tokens)
    loss0.backward()
    model = _model("projected", 2, "full", backend="reference")
    loss1 = _loss(model, tokens)
    loss1.backward()
    _assert_same(ref, loss0, model, loss1)
    with torch.no_grad():  # evaluation under AC: the reads run once, nothing recorded
        assert torch.equal(model(tokens), ref(tokens))


# -- bytes -------------------------------------------------------------------------------------
class _Made(TorchDispatchMode):
    """The storages the ops under it return, by their storage's identity."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = ref
        return out


def _kept(model, tokens) -> int:
    """Bytes the forward (and the loss) leaves alive for the backward: the storages made under
    it, less the parameters' and buffers' (views of them are made too)."""
    own = {StorageWeakRef(t.untyped_storage()).cdata for t in (*model.parameters(),
                                                               *model.buffers())}  # fmt: skip
    made = _Made()
    with made:
        loss = _loss(model, tokens)
    kept = sum(_bytes(ref) for key, ref in made.refs.items() if key not in own)
    loss.backward()
    return kept


DEEP = Flavor(dim=32, n_layers=8, n_heads=2, hidden_dim=64, vocab_size=256, max_seq_len=32)


@pytest.mark.parametrize("ac", sorted(AC))
def test_the_forward_keeps_what_the_baseline_keeps(ac, monkeypatch):
    """16 sublayers, Block N=4. The baseline keeps one [T, d] per sublayer (its residual stream);
    the routed model one partial or block sum per sublayer, plus the last block's sum (an input of
    the last read only) and, projected, r-wide keys: per sublayer its partial's fp32 key, the r
    key columns of the [W^O; W^K] product where that is kept (a block's first member, and under
    selective AC every MLP's), the embedding's key. Nothing of the reads: their outputs' memory is
    given back once the sublayers reading them ran, the phase-1 LSEs' too (the eager checkpoint
    keeps a read's tuple as it is, whose LSE is a view of its block's). Without that, each
    sublayer keeps its h: one more [T, d] per sublayer but the last."""
    tokens = _tokens(DEEP, seq=16)
    unit = tokens.numel() * DEEP.dim * 4  # one fp32 [T, d]
    keys = tokens.numel() * RANK * 4 * 2 * (2 * DEEP.n_layers)  # two fp32 [T, r] per sublayer
    base = _kept(_model("baseline", None, ac, flavor=DEEP), tokens)
    sliced = _kept(_model("sliced", 4, ac, flavor=DEEP), tokens)
    projected = _kept(_model("projected", 4, ac, flavor=DEEP), tokens)
    assert sliced - base == unit  # measured: exactly
    # measured: keys of 5.6 [T, d] under full AC, 7.6 under selective, of the 8 allowed
    assert unit < projected - base <= unit + keys

    monkeypatch.setattr(depth._GivenBack, "give_back", lambda self: None)
    kept = _kept(_model("sliced", 4, ac, flavor=DEEP), tokens)
    assert kept - base >= unit * (2 * DEEP.n_layers - 1)


def test_the_model_config_turns_it_on_with_activation_checkpointing():
    from train_configs.cpu import cpu_smoke

    c = cpu_smoke()
    c.model_spec.model.update_from_config(config=c)
    assert c.activation_checkpoint is None and not c.model_spec.model.router.recompute_reads
    c = cpu_smoke()
    c.activation_checkpoint = SelectiveAC.Config()
    c.model_spec.model.update_from_config(config=c)
    assert c.model_spec.model.router.recompute_reads
