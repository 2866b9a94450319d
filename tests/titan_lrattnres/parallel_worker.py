"""Launcher for the tensor- and pipeline-parallel tests: ``python parallel_worker.py MODEL
[trainer CLI ...]`` (also under torchrun). Runs ``titan_lrattnres.train`` on ``cpu_smoke``
(or another base config: ``main(argv, base=...)``, as ``parallel/recipe_worker.py`` does) with the
model ``MODEL`` (``"<variant>[_full][_small][_ref][_v<vocab>]"``: flavor ``debug``, L=2, Block
N=2, r=16, the base config's depth backend; ``_full``: Full; ``_small``: flavor ``cpu_small``,
L=4; ``_ref``: the ``reference`` depth backend; e.g. ``sliced``, ``projected``,
``attnres_full``, ``sliced_small``, ``projected_ref``, ``sliced_v1000``) and two test hooks:

- the gradient-clipping norm is computed in float64: torch's fp32 ``vector_norm`` on CPU
  accumulates sequentially (measured: 8e-5 relative error on the head's gradient of a
  ``cpu_smoke`` step), more than the parity tolerance, and its error depends on the shard sizes;
- with ``TP_DUMP=FILE``, after training rank 0 writes the full parameters (of every rank's model
  parts) and the logits of a fixed batch (``tokens``) as computed by the (parallel) model: the
  vocabulary shards gathered under TP, through the pipeline schedule under PP;
- with ``TP_GRADS=FILE``, rank 0 writes every parameter's full gradient of step 1 (before
  clipping), gathered from every rank.
"""

from __future__ import annotations

import os
import sys

from titan_lrattnres.training import cpu

cpu.apply()

import spmd_types as spmd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchtitan.trainer as tt  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def dump_tokens(seq: int) -> torch.Tensor:
    """A fixed batch of 2 x ``seq`` token ids (< 1000)."""
    return torch.arange(2 * seq).reshape(2, seq) * 37 % 1000


MODEL_ARGS: dict = {}  # build_model_config arguments of the registered model (flavor included)


def _fp64_total_norm(original):
    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        norm = original([t.double() for t in tensors], norm_type, error_if_nonfinite, foreach)
        return norm.float()

    return total_norm


torch.nn.utils.get_total_norm = _fp64_total_norm(torch.nn.utils.get_total_norm)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _fqn(name: str) -> str:
    """The parameter's name without activation-checkpoint (or compile) wrappers."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    return canonical_fqn(name)


def _by_name(parts, of) -> dict:
    """``of(parameter)`` for every parameter of every model part on every rank, by name."""
    return _gather({_fqn(n): _full(of(p)) for m in parts for n, p in m.named_parameters()})


def _gather(mine: dict) -> dict:
    """The union of every rank's dict (pipeline stages hold different parameters)."""
    if not dist.is_initialized():
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _pipeline_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens``' logits through the pipeline schedule (one row per microbatch, cycled)."""
    last = trainer.model_parts[-1]
    n = trainer.num_pipeline_parallel_microbatches
    if trainer.pp_has_last_stage:
        last._skip_lm_head = False
    schedule = trainer.pp_schedule
    loss_fn, schedule._loss_fn = schedule._loss_fn, None  # outputs only: no targets, no loss
    first = trainer.pp_has_first_stage
    try:
        with trainer.train_context():
            out = schedule.eval(
                arg_mbs=[(tokens[i % len(tokens)][None],) for i in range(n)] if first else None,
                kwarg_mbs=[{} for _ in range(n)],
            )
    finally:
        schedule._loss_fn = loss_fn
    logits = [None]
    if trainer.pp_has_last_stage:
        logits = [_gather_vocab(trainer, _full(out[: len(tokens)]))]
    dist.broadcast_object_list(logits, src=dist.get_world_size() - 1)
    return logits[0]


@torch.no_grad()
def dump(trainer, path: str) -> None:
    params = _by_name(trainer.model_parts, lambda p: p)
    if trainer.parallel_dims.pp_enabled:  # the stages' buffers have the training shapes
        tokens = dump_tokens(trainer.config.training.seq_len)
        logits = _pipeline_logits(trainer, tokens)
    else:
        tokens = dump_tokens(32)
        logits = _tp_logits(trainer, tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        args = dict(MODEL_ARGS)
        torch.save({"params": params, "logits": logits, "tokens": tokens, "model_args": args}, path)


def _tp_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    model = trainer.model_parts[0]
    skip = model._skip_lm_head
    model._skip_lm_head = True
    # the SPMD mesh (without it no TP collective runs), no type checking: torchtitan's RoPE
    # refuses the untyped positions of a call outside the training step
    with trainer.train_context(), spmd.no_typecheck():
        logits = _full(model.lm_head(model(tokens)))
    model._skip_lm_head = skip
    return _gather_vocab(trainer, logits)


def _gather_vocab(trainer, logits: torch.Tensor) -> torch.Tensor:
    """Under TP each rank holds a vocabulary shard of the logits: the whole of them."""
    tp = trainer.parallel_dims.tp
    if tp > 1:
        group = trainer.parallel_dims.get_mesh("tp").get_group()
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits


def register(model: str, base=None) -> str:
    """Register config ``tp_<model>``: ``base()`` (default ``cpu_smoke``) with another model;
    returns its name."""
    import titan_lrattnres.config_registry as registry
    from titan_lrattnres import model_registry
    from train_configs import CONFIGS
    from train_configs.cpu import cpu_smoke

    base = base or cpu_smoke

    parts = model.split("_")
    kwargs = dict(flavor="debug", variant=parts[0], blocks=2, rank=16)
    backend = None  # the base config's
    for p in parts[1:]:
        if p == "full":
            kwargs["blocks"] = None
        elif p == "small":
            kwargs["flavor"] = "cpu_small"
        elif p == "ref":
            backend = "reference"
        elif p.startswith("v"):
            kwargs["vocab_size"] = int(p[1:])
        else:
            raise ValueError(f"unknown model part {p!r}")

    def config():
        c = base()
        depth_backend = backend or c.model_spec.model.router.backend
        c.model_spec = model_registry(depth_backend=depth_backend, **kwargs)
        return c

    MODEL_ARGS.update(kwargs)
    name = f"tp_{model}"
    CONFIGS[name] = config
    setattr(registry, name, config)
    return name


def main(argv: list[str], base=None) -> int:
    """Train ``argv`` = ``[MODEL, trainer CLI ...]`` on ``base()`` (see :func:`register`)."""
    from titan_lrattnres.train import main as train_main

    grads = os.environ.get("TP_GRADS")
    if grads:  # the gradients of step 1, before clipping
        clip = tt.dist_utils.clip_grad_norm_

        def clip_and_dump(params, *args, **kwargs):
            if not os.path.exists(grads):
                full = _by_name(tt.Trainer._dump_parts, lambda p: p.grad)
                if int(os.environ.get("RANK", "0")) == 0:
                    torch.save(full, grads)
                dist.barrier()
            return clip(params, *args, **kwargs)

        tt.dist_utils.clip_grad_norm_ = clip_and_dump
        init = tt.Trainer.__init__

        def init_and_keep(self, *args, **kwargs):
            init(self, *args, **kwargs)
            tt.Trainer._dump_parts = self.model_parts

        tt.Trainer.__init__ = init_and_keep
    path = os.environ.get("TP_DUMP")
    if path:
        original = tt.Trainer.train

        def train(self):
            original(self)
            dump(self, path)

        tt.Trainer.train = train
    return train_main([register(argv[0], base), *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
