"""The paper's Muon (Polar Express + NorMuon + cautious decay) for FSDP2, HSDP and TP.

One step for a matrix ``W`` (``rows x cols``; a >2-D weight is viewed as ``[shape[0], -1]``) with
gradient ``G``, as in the LR-AttnRes authors' code (``muon/muon.py``; docs/training.md):

    M <- lerp(M, G, 1 - mu)                      momentum, on the local block
    U <- lerp(G, M, mu)                          Nesterov
    O <- PolarExpress(U)                         5 quintic steps on the FULL matrix
    s <- mean(O^2) per row (rows >= cols) or per column (rows < cols)
    V <- lerp(V, s, 1 - beta2)                   NorMuon second moment, no bias correction
    O <- O * rsqrt(max(V, 1e-10)) * ||O_before||_F / max(||O||_F, 1e-10)
    O <- O * max(1, rows / cols) ** 0.5
    W <- W - lr * wd * [O * W >= 0] * W - lr * O      cautious weight decay, then the update

Distributed design (owner-compute). Muon takes parameters that are DTensors sharded over any
mesh dims (``Shard`` or, as FSDP2 lays out a tensor-parallel weight, ``_StridedShard``) and
replicated over the others: FSDP2 shards every weight by rows (``Shard(0)``, torch.chunk sizes,
so the last ranks may hold fewer or zero rows); HSDP adds a replicate mesh dim whose ranks already
hold equal gradients; tensor parallel (TP) shards column-wise weights (``wqkv``, ``w1``, ``w3``)
by rows and row-wise ones (``wo``, ``w2``) by columns, and FSDP2 then shards the rows of either
(torchtitan 0.3.0 under FSDP2 x TP: ``(_StridedShard(0, sf=tp), Shard(0))`` and
``(Shard(0), Shard(1))`` on the ``(dp_shard, tp)`` mesh; at TP alone the same on a
``dp_shard`` dim of 1); a parameter TP replicates (``embedding_key``:
``(Shard(0), Replicate())``) is held whole by every TP rank. The exchange runs over one process
group per mesh: the mesh dims that shard any Muon parameter, flattened (FSDP2 x TP: the
``dp_shard x tp`` ranks; HSDP: one such group per replica). Every rank knows which block
(rows x columns, DTensor's chunk rules) each group rank holds. Each matrix gets one owner rank
(greedy balance of ``rows * cols * min(rows, cols)``, the same on every rank). Per step:

1. every rank updates its momentum on its local block and sends its block of ``U`` (and its
   slice of ``V``) to each matrix's owner (a block several ranks hold, replicated over a mesh dim
   of the group, is sent by the first of them): one ``all_to_all_single`` over the group for all
   matrices;
2. each owner assembles its whole matrices and runs Polar Express + NorMuon on them;
3. one ``all_to_all_single`` sends every rank its block of the final update (and its slice of
   ``V``);
4. decay and update are applied to the local block.

Two collectives per step and group, whatever the number of matrices and mesh dims (FSDP2, HSDP,
TP and any mix of them); each rank orthogonalises ~1/W of the matrices (W: ranks in the group)
and moves ~2(W-1)/W^2 of the matrix bytes (an all-gather design moves (W-1)/W and repeats every
orthogonalisation on every rank). State is DTensors: ``momentum_buffer`` laid out like the
parameter; ``variance_buffer`` is ``[rows, 1]`` (per-row statistics) or ``[1, cols]`` (per
column), sharded along its long dim by every mesh dim that shards the parameter (``Shard``, in
mesh order) and replicated over the others, so DCP checkpoints and reshards it. The exchange is
fp32: the owner sees exactly the single-process matrix, so any layout and one process give the
same update bit for bit.

Fused matrices (``fuse``). The paper's MLP has one input matrix ``fc1 = [W1; W3]``
(``2 hidden x d``) that Muon orthogonalises whole; torchtitan keeps ``w1`` and ``w3`` apart, and
orthogonalising them apart gives another direction. ``fuse=(("feed_forward.w1.weight",
"feed_forward.w3.weight"),)`` makes every pair of parameters named ``P + suffix`` (same prefix
``P``, same group, same columns) one matrix: their rows are concatenated in the order given, and
Polar Express, the NorMuon statistics (per row of the concatenation when it is tall, else per
column) and the update scale ``max(1, rows / cols) ** 0.5`` are those of the concatenated
matrix. The parameters, their momentum and their state stay separate (each member keeps its
rows of the statistics; of a wide concatenation each keeps an identical copy of the column
statistics), so where each member is tall like the concatenation (every MLP here: hidden > d)
the checkpoint layout is the unfused one. Each member keeps its own layout (under TP both are
column-parallel: sharded by rows over TP and FSDP2); the pair has one owner, which gathers both
whole, concatenates, orthogonalises and sends each rank its block of each member.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

# torch names without a public alias: leaving fake mode to read a mesh's ranks (the memory
# benchmark builds the optimizer under fake tensors), and FSDP2's placement for the dim it
# shards of a tensor-parallel weight
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

# Polar Express, 5 steps (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): the series
# optimal_composition(l=1e-3, num_iters=5, safety_factor_eps=2e-2, cushion=0.02) of
# github.com/NoahAmsel/PolarExpress (regenerated: equal to 1e-14), identical to
# KellerJordan/modded-nanogpt train_gpt.py and to the LR-AttnRes code's muon/muon.py.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NORM_SAFETY = 1.02  # divide by ||G||_F * 1.02 (+ 1e-6): spectral norm below 1 before step 1
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def polar_express(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[rows, cols]`` -> the approximate polar factor ``U V^T`` of ``g`` (same shape, ``dtype``).

    Each step is ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the short side; matmuls run
    in ``dtype`` (bf16 as in the paper; fp32 for exact tests).
    """
    x = g.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() * NORM_SAFETY + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def normuon(o: torch.Tensor, variance: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon on an orthogonalised ``o`` ``[rows, cols]`` (fp32); updates ``variance`` in place
    (``[rows, 1]`` when rows >= cols, else ``[1, cols]``) and returns the rescaled update."""
    norm = o.norm()
    dim = -1 if o.shape[0] >= o.shape[1] else -2
    variance.lerp_(o.square().mean(dim=dim, keepdim=True), 1 - beta2)
    o = o * variance.clamp(min=1e-10).rsqrt()
    return o * (norm / o.norm().clamp(min=1e-10))


def orthogonalized_update(
    u: torch.Tensor, variance: torch.Tensor, beta2: float, dtype: torch.dtype
) -> torch.Tensor:
    """The full-matrix part of the step: Polar Express, NorMuon, shape scale (fp32 out)."""
    rows, cols = u.shape
    o = polar_express(u, dtype).float()
    o = normuon(o, variance, beta2)
    return o * max(1.0, rows / cols) ** 0.5


def chunk_sizes(n: int, world: int) -> list[int]:
    """Sizes of ``torch.chunk(n, world)`` padded to ``world`` entries (DTensor's ``Shard``, and
    FSDP2's rows: the last ranks may hold fewer or none)."""
    c = -(-n // world)
    return [max(0, min(c, n - i * c)) for i in range(world)]


def held(idx: list[int], parts: int, coord: int, split_factor: int = 1) -> list[int]:
    """The entries of ``idx`` that coordinate ``coord`` of a mesh dim of ``parts`` ranks holds:
    ``Shard`` (``split_factor`` 1, torch.chunk) or ``_StridedShard(split_factor=sf)`` (``idx``
    chunked into ``sf`` pieces, each piece into ``parts``; this coordinate's chunk of each).
    Plain integers, so that layouts build under fake tensors too (no tensor is read back)."""
    out, start = [], 0
    for size in chunk_sizes(len(idx), split_factor):
        piece, start = idx[start : start + size], start + size
        sizes = chunk_sizes(len(piece), parts)
        first = sum(sizes[:coord])
        out.extend(piece[first : first + sizes[coord]])
    return out


Index = slice | torch.Tensor


def _as_index(idx: list[int]) -> Index:
    """Increasing indices; a slice when they are one run, else an index tensor."""
    start = idx[0] if idx else 0
    stop = idx[-1] + 1 if idx else 0
    return slice(start, stop) if stop - start == len(idx) else torch.tensor(idx, dtype=torch.long)


def _length(i: Index) -> int:
    return i.stop - i.start if isinstance(i, slice) else len(i)


def _shard_dim(placement) -> int | None:
    """The tensor dim a placement shards (``Shard`` or ``_StridedShard``), else None."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


@dataclass
class _Group:
    """The ranks of one exchange: the mesh dims ``dims`` that shard any Muon parameter on the
    mesh, flattened; ``coords``: each group rank's mesh coordinate. ``group`` None: one rank."""

    dims: tuple[int, ...] = ()
    group: dist.ProcessGroup | None = None
    rank: int = 0
    coords: tuple[tuple[int, ...], ...] = ((),)


def _flatten(mesh: DeviceMesh, dims: tuple[int, ...]) -> _Group:
    me = tuple(mesh.get_coordinate())
    if not dims:
        return _Group(coords=(me,))
    # the mesh's ranks by coordinate, as plain lists (also when built under fake tensors)
    with unset_fake_temporarily():
        ranks = mesh.mesh.tolist()
    where = {}
    for coord in itertools.product(*map(range, mesh.shape)):
        rank = ranks
        for c in coord:
            rank = rank[c]
        where[rank] = coord
    if len(dims) == 1:
        group = mesh.get_group(dims[0])
    else:  # this rank's sub-mesh over ``dims`` (only its members take part in creating it)
        fixed = [k for k in range(len(me)) if k not in dims]
        sub = sorted(r for r, c in where.items() if all(c[k] == me[k] for k in fixed))
        group = dist.new_group(sub, use_local_synchronization=True)
    coords = tuple(where[g] for g in dist.get_process_group_ranks(group))
    return _Group(dims, group, dist.get_rank(group), coords)


@dataclass
class _Layout:
    """Where a parameter's matrix (``rows x cols``) lives across its exchange group ``grp``:
    ``blocks[r]`` = the (row, column) indices of the block group rank ``r`` holds; ``first[r]``
    = whether ``r`` holds the first copy of its block (a parameter replicated over a mesh dim
    of the group has several); ``stats[d][r]`` = the indices of ``r``'s slice of the NorMuon
    statistics when they are per row (``d`` 0) or per column (1). ``tall``: whether the matrix
    Muon orthogonalises (the parameter, or the fused matrix it is part of) has at least as many
    rows as columns; None = the parameter's own shape. Defaults: one rank holding all."""

    rows: int
    cols: int
    grp: _Group = field(default_factory=_Group)
    blocks: tuple[tuple[Index, Index], ...] = ()
    first: tuple[bool, ...] = (True,)
    stats: tuple[tuple[Index, ...], ...] = ()
    tall: bool | None = None

    def __post_init__(self):
        if not self.blocks:
            self.blocks = ((slice(0, self.rows), slice(0, self.cols)),)
            self.stats = ((slice(0, self.rows),), (slice(0, self.cols),))

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.grp.group

    @property
    def world(self) -> int:
        return len(self.blocks)

    @property
    def rank(self) -> int:
        return self.grp.rank

    @property
    def stat_dim(self) -> int:  # NorMuon: one statistic per row of a tall/square matrix
        tall = self.rows >= self.cols if self.tall is None else self.tall
        return 0 if tall else 1

    def stat_shape(self, n: int) -> tuple[int, int]:
        return (n, 1) if self.stat_dim == 0 else (1, n)

    def shape(self, r: int) -> tuple[int, int]:
        """Rank ``r``'s block as a matrix."""
        rows, cols = self.blocks[r]
        return _length(rows), _length(cols)

    def block(self, r: int) -> tuple[Index, Index]:
        """A key that reads or writes rank ``r``'s block of the whole matrix."""
        rows, cols = self.blocks[r]
        both = isinstance(rows, torch.Tensor) and isinstance(cols, torch.Tensor)
        return (rows[:, None], cols) if both else (rows, cols)

    def stat(self, r: int) -> tuple[Index, Index]:
        """A key that reads or writes rank ``r``'s slice of the whole statistics."""
        i = self.stats[self.stat_dim][r]
        return (i, slice(None)) if self.stat_dim == 0 else (slice(None), i)

    def sizes(self, r: int) -> tuple[int, int]:
        """(update elements, statistic elements) that rank ``r`` holds."""
        return math.prod(self.shape(r)), _length(self.stats[self.stat_dim][r])


def _layout(p: torch.Tensor, grp: _Group | None) -> _Layout:
    """``p``'s layout over ``grp`` (its mesh's exchange group); refuses what Muon cannot take."""
    rows, cols = p.shape[0], math.prod(p.shape[1:])
    if not isinstance(p, DTensor):
        return _Layout(rows, cols)
    shards = []  # (mesh dim, matrix dim, split factor)
    for k, pl in enumerate(p.placements):
        d = _shard_dim(pl)
        if d is None and not pl.is_replicate():
            raise NotImplementedError(
                f"Muon takes parameters sharded or replicated on each mesh dim, got {p.placements}"
            )
        if d is not None:
            d %= p.ndim
            if d and p.ndim > 2:
                raise NotImplementedError(
                    f"Muon takes a >2-D weight sharded by dim 0 only, got {p.placements}"
                )
            sf = pl.split_factor if isinstance(pl, _StridedShard) else 1
            shards.append((k, min(d, 1), p.device_mesh.size(k), sf))
    blocks, first, stats = [], [], ([], [])
    for coord in grp.coords:
        idx, stat = [list(range(rows)), list(range(cols))], [list(range(rows)), list(range(cols))]
        for k, d, parts, sf in shards:
            idx[d] = held(idx[d], parts, coord[k], sf)
            stat = [held(s, parts, coord[k]) for s in stat]
        blocks.append((_as_index(idx[0]), _as_index(idx[1])))
        for d in (0, 1):
            stats[d].append(_as_index(stat[d]))
        replicated = [k for k in grp.dims if _shard_dim(p.placements[k]) is None]
        first.append(all(coord[k] == 0 for k in replicated))
    lay = _Layout(rows, cols, grp, tuple(blocks), tuple(first), tuple(map(tuple, stats)))
    local, (n, m) = p.to_local(), lay.shape(grp.rank)
    if tuple(local.shape) != ((n, m) if p.ndim == 2 else (n, *p.shape[1:])):
        raise RuntimeError(
            f"Muon: a local shard of shape {tuple(local.shape)} is not the {n} x {m} block that "
            f"placements {p.placements} give a {tuple(p.shape)} parameter"
        )
    return lay


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _matrix(t: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """This rank's block as a ``[rows, cols]`` view (explicit sizes: a shard may hold none)."""
    return t.view(lay.shape(lay.rank))


@dataclass
class _Member:
    """One parameter in a step: its layout, local rows of ``U`` (fp32), local statistics."""

    param: torch.Tensor
    lay: _Layout
    u: torch.Tensor
    var: torch.Tensor


@dataclass
class _Unit:
    """The matrix Muon orthogonalises: one parameter, or fused parameters' rows concatenated."""

    group: dict
    members: list[_Member]

    @property
    def cols(self) -> int:
        return self.members[0].lay.cols

    @property
    def rows(self) -> int:
        return sum(m.lay.rows for m in self.members)

    @property
    def tall(self) -> bool:
        return self.rows >= self.cols

    def update(self, us: list[torch.Tensor], vs: list[torch.Tensor]):
        """Full rows of ``U`` and full statistics per member (fp32) -> (update, statistics) per
        member; the statistics of a wide unit are one copy shared by all members."""
        u = us[0] if len(us) == 1 else torch.cat(us)
        var = vs[0] if len(vs) == 1 or not self.tall else torch.cat(vs)
        g = self.group
        o = orthogonalized_update(u, var, g["beta2"], DTYPES[g["ortho_dtype"]])
        rows = [m.lay.rows for m in self.members]
        if len(rows) == 1:
            return [o], [var]
        stats = list(var.split(rows)) if self.tall else [var] * len(rows)
        return list(o.split(rows)), stats


def assign_owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """Owner rank per matrix: largest first onto the least-loaded rank (cost m n min(m, n))."""
    load = [0.0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-math.prod(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        m, n = shapes[i]
        load[r] += m * n * min(m, n)
    return owners


class Muon(torch.optim.Optimizer):
    """Muon with Polar Express, NorMuon and cautious weight decay; FSDP2 / HSDP / TP aware.

    Group options: ``lr``, ``weight_decay`` (multiplied by lr, cautious), ``momentum`` (set per
    step by :class:`titan_lrattnres.components.optimizers.MomentumLRSchedulers` when used),
    ``nesterov``, ``beta2`` (NorMuon), ``ortho_dtype`` ("bfloat16" | "float32"). Unknown keys that
    torchtitan adds (``fused``, ``foreach``) are ignored. ``fuse``: tuples of name suffixes whose
    parameters are one matrix (module docstring; needs the groups' ``param_names``, which
    torchtitan's container sets); a constructor argument, not a group option, so checkpoints do
    not depend on it. ``collectives`` counts this optimizer's all-to-alls since construction.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        beta2: float = 0.95,
        ortho_dtype: str = "bfloat16",
        fuse: Sequence[Sequence[str]] = (),
        **ignored,
    ):
        if ortho_dtype not in DTYPES:
            raise ValueError(f"ortho_dtype must be one of {list(DTYPES)}, got {ortho_dtype!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            beta2=beta2,
            ortho_dtype=ortho_dtype,
        )
        super().__init__(params, defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if p.ndim < 2:
                raise ValueError(f"Muon takes >= 2-D weights, got shape {tuple(p.shape)}")
        # one exchange group per mesh, over the mesh dims that shard any parameter (created in
        # the same order on every rank); layouts are fixed, and refused now, not at a step
        dims: dict[DeviceMesh, set[int]] = {}
        for p in params:
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                dims.setdefault(mesh, set()).update(
                    k
                    for k, pl in enumerate(p.placements)
                    if _shard_dim(pl) is not None and mesh.size(k) > 1
                )
        groups = {mesh: _flatten(mesh, tuple(sorted(d))) for mesh, d in dims.items()}
        self._layouts = {
            id(p): _layout(p, groups[p.device_mesh] if isinstance(p, DTensor) else None)
            for p in params
        }
        self.fuse = tuple(tuple(suffixes) for suffixes in fuse)
        self._fused = self._fuse_units()
        self.collectives = 0

    def _fuse_units(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """``id(first member) -> members`` for every fused matrix, and ``id(other member) ->
        ()`` (stepped with its first member); refuses incomplete or mismatched sets."""
        units: dict[int, tuple[torch.Tensor, ...]] = {}
        if not self.fuse:
            return units
        for group in self.param_groups:
            names = group.get("param_names")
            if names is None:
                raise ValueError("Muon(fuse=...) needs param groups with param_names")
            by_name = dict(zip(names, group["params"]))
            for suffixes in self.fuse:
                if len(suffixes) < 2 or len(set(suffixes)) < len(suffixes):
                    raise ValueError(f"fuse takes 2+ distinct name suffixes, got {suffixes}")
                prefixes = {n[: -len(s)] for n in names for s in suffixes if n.endswith(s)}
                for prefix in sorted(prefixes):
                    wanted = [prefix + s for s in suffixes]
                    missing = [n for n in wanted if n not in by_name]
                    if missing:
                        raise ValueError(f"fuse {suffixes}: {missing} not in this param group")
                    members = tuple(by_name[n] for n in wanted)
                    cols = {math.prod(p.shape[1:]) for p in members}
                    if len(cols) > 1:
                        raise ValueError(f"fuse {wanted}: the columns differ ({sorted(cols)})")
                    if any(id(p) in units for p in members):
                        raise ValueError(f"fuse {wanted}: a parameter is in two fused matrices")
                    units[id(members[0])] = members
                    units.update((id(p), ()) for p in members[1:])
        return units

    def _init_state(self, p: torch.Tensor, lay: _Layout) -> dict:
        state = self.state[p]
        state["momentum_buffer"] = torch.zeros_like(p)
        local = torch.zeros(lay.stat_shape(lay.sizes(lay.rank)[1]), dtype=p.dtype, device=p.device)
        if isinstance(p, DTensor):
            shape = lay.stat_shape(lay.rows if lay.stat_dim == 0 else lay.cols)
            placements = [
                Shard(lay.stat_dim) if _shard_dim(pl) is not None else pl for pl in p.placements
            ]
            local = DTensor.from_local(
                local, p.device_mesh, placements, run_check=False, shape=shape, stride=(shape[1], 1)
            )
        state["variance_buffer"] = local
        return state

    def _unit(self, group: dict, params: tuple[torch.Tensor, ...]) -> _Unit | None:
        """Momentum and Nesterov on the local block of each member; None without gradients."""
        have = [p.grad is not None for p in params]
        if not any(have):
            return None
        if not all(have):
            raise RuntimeError("Muon: some parameters of a fused matrix have no gradient")
        lays = [self._layouts[id(p)] for p in params]
        if len(params) > 1:
            if len({(lay.group, lay.world, lay.rank) for lay in lays}) > 1:
                raise NotImplementedError("Muon: fused parameters must share one mesh")
            tall = sum(lay.rows for lay in lays) >= lays[0].cols
            lays = [replace(lay, tall=tall) for lay in lays]
        mu = group["momentum"]
        members = []
        for p, lay in zip(params, lays):
            state = self.state[p] or self._init_state(p, lay)
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                raise RuntimeError(
                    f"Muon: a gradient laid out as {p.grad.placements}, its parameter as "
                    f"{p.placements}"
                )
            g = _local(p.grad).reshape(lay.shape(lay.rank))
            m = _matrix(_local(state["momentum_buffer"]), lay)
            m.lerp_(g, 1 - mu)
            u = g.lerp(m, mu) if group["nesterov"] else m.clone()
            members.append(_Member(p, lay, u.float(), _local(state["variance_buffer"])))
        return _Unit(group, members)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work: list[_Unit] = []
        for group in self.param_groups:
            for p in group["params"]:
                params = self._fused.get(id(p), (p,))
                if params and (unit := self._unit(group, params)) is not None:
                    work.append(unit)
        buckets: dict[int, list[_Unit]] = {}
        for unit in work:
            buckets.setdefault(id(unit.members[0].lay.group), []).append(unit)
        for bucket in buckets.values():
            world = bucket[0].members[0].lay.world
            updates = self._exchange(bucket) if world > 1 else self._compute(bucket)
            for unit, upds in zip(bucket, updates):
                lr, wd = unit.group["lr"], unit.group["weight_decay"]
                for member, upd in zip(unit.members, upds):
                    w = _matrix(_local(member.param), member.lay)
                    upd = upd.to(w.dtype)
                    if wd:
                        w.addcmul_((upd * w >= 0).to(w.dtype), w, value=-lr * wd)
                    w.add_(upd, alpha=-lr)
        return loss

    def _compute(self, bucket: list[_Unit]) -> list[list[torch.Tensor]]:
        """All rows are local: orthogonalise each matrix here."""
        out = []
        for unit in bucket:
            vs = [m.var.float() for m in unit.members]
            upds, stats = unit.update([m.u for m in unit.members], vs)
            for m, v in zip(unit.members, stats):
                m.var.copy_(v)
            out.append(upds)
        return out

    def _exchange(self, bucket: list[_Unit]) -> list[list[torch.Tensor]]:
        """Owner-compute over one group: blocks to owners, whole-matrix update, blocks back."""
        lay0 = bucket[0].members[0].lay
        group, world, me = lay0.group, lay0.world, lay0.rank
        owners = assign_owners([(unit.rows, unit.cols) for unit in bucket], world)
        mine = [i for i, o in enumerate(owners) if o == me]
        empty = bucket[0].members[0].u.new_empty(0)  # a rank that owns nothing sends nothing

        def a2a(send_parts: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
            send = torch.cat([t.reshape(-1) for parts in send_parts for t in parts] or [empty])
            recv = send.new_empty(sum(recv_sizes))
            send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
            self.collectives += 1
            return list(recv.split(recv_sizes))

        def sent(i: int, r: int) -> list[_Member]:  # the members of unit i that rank r sends
            return [m for m in bucket[i].members if m.lay.first[r]]

        # 1. my block of U and my slice of V of every member (first copies), to each owner
        send = [[] for _ in range(world)]
        for i in range(len(bucket)):
            send[owners[i]] += [t for m in sent(i, me) for t in (m.u, m.var.float())]
        received = a2a(
            send, [sum(sum(m.lay.sizes(s)) for i in mine for m in sent(i, s)) for s in range(world)]
        )
        # 2. the owner's whole matrices, assembled from the ranks' blocks and slices
        full = {}
        for i in mine:
            full[i] = [
                (
                    m.u.new_empty(m.lay.rows, m.lay.cols),
                    m.u.new_empty(
                        m.lay.stat_shape(m.lay.rows if m.lay.stat_dim == 0 else m.lay.cols)
                    ),
                )
                for m in bucket[i].members
            ]
        for s, buf in enumerate(received):
            off = 0
            for i in mine:
                for m, (u, v) in zip(bucket[i].members, full[i]):
                    if m.lay.first[s]:
                        nu, nv = m.lay.sizes(s)
                        u[m.lay.block(s)] = buf[off : off + nu].view(m.lay.shape(s))
                        v[m.lay.stat(s)] = buf[off + nu : off + nu + nv].view(m.lay.stat_shape(nv))
                        off += nu + nv
        back = [[] for _ in range(world)]
        for i in mine:
            unit = bucket[i]
            upds, stats = unit.update([u for u, _ in full[i]], [v for _, v in full[i]])
            for m, o, v in zip(unit.members, upds, stats):
                for r in range(world):
                    back[r] += [o[m.lay.block(r)], v[m.lay.stat(r)]]
        # 3. my block of every update and my slice of every V
        returned = a2a(
            back,
            [
                sum(
                    sum(m.lay.sizes(me))
                    for i, o in enumerate(owners)
                    if o == s
                    for m in bucket[i].members
                )
                for s in range(world)
            ],
        )
        out: list[list[torch.Tensor]] = []
        offsets = [0] * world
        for i, unit in enumerate(bucket):
            s, upds = owners[i], []
            for m in unit.members:
                nu, nv = m.lay.sizes(me)
                buf, off = returned[s], offsets[s]
                upds.append(buf[off : off + nu].view(m.lay.shape(me)))
                m.var.copy_(buf[off + nu : off + nu + nv].view(m.var.shape))
                offsets[s] = off + nu + nv
            out.append(upds)
        return out
