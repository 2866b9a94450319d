"""The paper's Muon (Polar Express + NorMuon + cautious decay) for FSDP2 and HSDP.

One step for a matrix ``W`` (``rows x cols``; a >2-D weight is viewed as ``[shape[0], -1]``) with
gradient ``G``, as in the LR-AttnRes authors' code (``muon/muon.py``; docs/training.md):

    M <- lerp(M, G, 1 - mu)                      momentum, on the local shard
    U <- lerp(G, M, mu)                          Nesterov
    O <- PolarExpress(U)                         5 quintic steps on the FULL matrix
    s <- mean(O^2) per row (rows >= cols) or per column (rows < cols)
    V <- lerp(V, s, 1 - beta2)                   NorMuon second moment, no bias correction
    O <- O * rsqrt(max(V, 1e-10)) * ||O_before||_F / max(||O||_F, 1e-10)
    O <- O * max(1, rows / cols) ** 0.5
    W <- W - lr * wd * [O * W >= 0] * W - lr * O      cautious weight decay, then the update

Distributed design (owner-compute). FSDP2 shards every weight by rows (``Shard(0)``, torch.chunk
sizes, so the last ranks may hold fewer or zero rows); HSDP adds a replicate mesh dimension whose
ranks already hold equal gradients. Each matrix gets one owner rank in the shard group (greedy
balance of ``rows * cols * min(rows, cols)``, the same on every rank). Per step:

1. every rank updates its momentum rows locally and sends its rows of ``U`` (and its slice of
   ``V``) to each matrix's owner: one ``all_to_all_single`` over the shard group for all matrices;
2. each owner runs Polar Express + NorMuon on its full matrices;
3. one ``all_to_all_single`` sends every rank its rows of the final update (and of ``V``);
4. decay and update are applied to the local rows.

Two collectives per step and shard group, whatever the number of matrices; each rank
orthogonalises ~1/W of them and moves ~2(W-1)/W^2 of the matrix bytes (an all-gather design moves
(W-1)/W and repeats every orthogonalisation on every rank). HSDP replicas run the same exchange
on their own shard sub-mesh. State is DTensors laid out like the parameter (``momentum_buffer``;
``variance_buffer`` is ``[rows, 1]`` sharded by rows or ``[1, cols]`` sharded by columns), so DCP
checkpoints and reshards it. The exchange is fp32: the owner sees exactly the single-process
matrix, so 2 ranks and 1 process give the same update bit for bit.

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
the checkpoint layout is the unfused one. Under FSDP2 each member is sharded by its own rows;
the pair has one owner, which gathers both whole, concatenates, orthogonalises and sends each
rank its rows of each member.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

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
    """Rows per rank of ``torch.chunk(n, world)`` padded to ``world`` entries (FSDP2's layout)."""
    c = -(-n // world)
    return [max(0, min(c, n - i * c)) for i in range(world)]


@dataclass
class _Layout:
    """Where a parameter's rows live: ``group`` = shard process group (None: all local).
    ``tall``: whether the matrix Muon orthogonalises (the parameter, or the fused matrix it is
    part of) has at least as many rows as columns; None = the parameter's own shape."""

    rows: int
    cols: int
    group: dist.ProcessGroup | None = None
    world: int = 1
    rank: int = 0
    tall: bool | None = None

    @property
    def stat_dim(self) -> int:  # NorMuon: one statistic per row of a tall/square matrix
        tall = self.rows >= self.cols if self.tall is None else self.tall
        return 0 if tall else 1

    def row_sizes(self) -> list[int]:
        return chunk_sizes(self.rows, self.world)

    def stat_sizes(self) -> list[int]:
        return chunk_sizes(self.rows if self.stat_dim == 0 else self.cols, self.world)

    def stat_shape(self, n: int) -> tuple[int, int]:
        return (n, 1) if self.stat_dim == 0 else (1, n)

    def sizes(self, r: int) -> tuple[int, int]:
        """(update elements, statistic elements) that rank ``r`` holds."""
        return self.row_sizes()[r] * self.cols, self.stat_sizes()[r]


def _layout(p: torch.Tensor) -> _Layout:
    rows, cols = p.shape[0], math.prod(p.shape[1:])
    if not isinstance(p, DTensor):
        return _Layout(rows, cols)
    shard = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    others = [pl for pl in p.placements if not isinstance(pl, Shard) and not pl.is_replicate()]
    if others or len(shard) > 1 or (shard and p.placements[shard[0]].dim != 0):
        raise NotImplementedError(
            "Muon supports FSDP2 / HSDP row sharding (one Shard(0) mesh dim), not tensor "
            f"parallel; got placements {p.placements}"
        )
    if not shard:
        return _Layout(rows, cols)
    mesh, i = p.device_mesh, shard[0]
    return _Layout(rows, cols, mesh.get_group(i), mesh.size(i), mesh.get_local_rank(i))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _matrix(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``[rows, ...]`` -> ``[rows, cols]`` view (explicit rows: a shard may hold none)."""
    return t.view(t.shape[0], cols)


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
    """Muon with Polar Express, NorMuon and cautious weight decay; FSDP2/HSDP aware.

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
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes >= 2-D weights, got shape {tuple(p.shape)}")
                _layout(p)  # refuses a layout it cannot handle now, not at the first step
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
        local = torch.zeros(
            lay.stat_shape(lay.stat_sizes()[lay.rank]), dtype=p.dtype, device=p.device
        )
        if isinstance(p, DTensor):
            shape = lay.stat_shape(lay.rows if lay.stat_dim == 0 else lay.cols)
            placements = [
                Shard(lay.stat_dim) if isinstance(pl, Shard) else pl for pl in p.placements
            ]
            local = DTensor.from_local(
                local, p.device_mesh, placements, run_check=False, shape=shape, stride=(shape[1], 1)
            )
        state["variance_buffer"] = local
        return state

    def _unit(self, group: dict, params: tuple[torch.Tensor, ...]) -> _Unit | None:
        """Momentum and Nesterov on the local rows of each member; None without gradients."""
        have = [p.grad is not None for p in params]
        if not any(have):
            return None
        if not all(have):
            raise RuntimeError("Muon: some parameters of a fused matrix have no gradient")
        lays = [_layout(p) for p in params]
        if len(params) > 1:
            if len({(lay.group, lay.world, lay.rank) for lay in lays}) > 1:
                raise NotImplementedError("Muon: fused parameters must share one shard group")
            tall = sum(lay.rows for lay in lays) >= lays[0].cols
            lays = [replace(lay, tall=tall) for lay in lays]
        mu = group["momentum"]
        members = []
        for p, lay in zip(params, lays):
            state = self.state[p] or self._init_state(p, lay)
            g = _local(p.grad)
            g = g.reshape(g.shape[0], lay.cols)
            m = _matrix(_local(state["momentum_buffer"]), lay.cols)
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
                    w = _matrix(_local(member.param), member.lay.cols)
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
        """Owner-compute over one shard group: rows to owners, full-matrix update, rows back."""
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

        def held(i: int, r: int) -> int:  # elements of unit i (U rows and statistics) on rank r
            return sum(sum(m.lay.sizes(r)) for m in bucket[i].members)

        # 1. my rows of U and my slice of V of every member, to each matrix's owner
        send = [[] for _ in range(world)]
        for i, unit in enumerate(bucket):
            for m in unit.members:
                send[owners[i]] += [m.u, m.var.float()]
        received = a2a(send, [sum(held(i, s) for i in mine) for s in range(world)])
        # 2. the owner's full matrices: per member, the ranks' rows and statistics in rank order
        full_u = {i: [[] for _ in bucket[i].members] for i in mine}
        full_v = {i: [[] for _ in bucket[i].members] for i in mine}
        for s, buf in enumerate(received):
            off = 0
            for i in mine:
                for k, m in enumerate(bucket[i].members):
                    lay = m.lay
                    nu, nv = lay.sizes(s)
                    full_u[i][k].append(buf[off : off + nu].view(nu // lay.cols, lay.cols))
                    full_v[i][k].append(buf[off + nu : off + nu + nv].view(lay.stat_shape(nv)))
                    off += nu + nv
        back = [[] for _ in range(world)]
        for i in mine:
            unit = bucket[i]
            us = [torch.cat(parts) for parts in full_u[i]]
            dim = unit.members[0].lay.stat_dim
            vs = [torch.cat(parts, dim=dim) for parts in full_v[i]]
            upds, stats = unit.update(us, vs)
            for m, o, v in zip(unit.members, upds, stats):
                rows = o.split(m.lay.row_sizes())
                slices = v.split(m.lay.stat_sizes(), dim=dim)
                for r in range(world):
                    back[r] += [rows[r], slices[r]]
        # 3. my rows of every update and my slice of every V
        returned = a2a(
            back,
            [sum(held(i, me) for i, o in enumerate(owners) if o == s) for s in range(world)],
        )
        out: list[list[torch.Tensor]] = []
        offsets = [0] * world
        for i, unit in enumerate(bucket):
            s, upds = owners[i], []
            for m in unit.members:
                nu, nv = m.lay.sizes(me)
                buf, off = returned[s], offsets[s]
                upds.append(buf[off : off + nu].view(nu // m.lay.cols, m.lay.cols))
                m.var.copy_(buf[off + nu : off + nu + nv].view(m.var.shape))
                offsets[s] = off + nu + nv
            out.append(upds)
        return out
