"""The private torchtitan / torch names the package depends on
(``titan_lrattnres.torchtitan_internals``): each exists, with the signature it was
written for, at the pinned torchtitan. A torchtitan upgrade that renames or reshapes one fails
here by name; then re-check the function of ``torchtitan_internals`` that uses it."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.loss import BaseLoss
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import pipeline_parallel as pp
from torchtitan.models.common.decoder import Decoder
from torchtitan.trainer import Trainer

from titan_lrattnres import torchtitan_internals as internals
from titan_lrattnres.components.checkpoint import LRAttnResCheckpointManager
from titan_lrattnres.components.optimizers import MuonOptimizersContainer
from titan_lrattnres.parallel import pipeline
from titan_lrattnres.training import cpu


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_installed_torchtitan_is_the_pinned_one():
    assert importlib.metadata.version("torchtitan") == cpu.TORCHTITAN_VERSION, (
        "torchtitan_internals was written for this version: re-check every name in this file"
    )


# (owner, name, parameter names) of every private callable the package calls or overrides
PRIVATE = [
    (pp, "_get_pipeline_metadata", ["parallel_dims", "parallelism", "model_config"]),
    (pp, "_generate_llm_fqn_per_model_part",
     ["num_stages", "num_layers", "input_weight", "output_weight"]),
    (pp, "_get_pp_rank_to_stage_indices_mapping",
     ["pp_rank", "pp_degree", "pp_schedule", "num_stages"]),
    (_PipelineSchedule, "_initialize_pp_stages",
     ["self", "stages", "args", "kwargs", "target", "fwd_initialized", "bwd_initialized",
      "loss_kwargs"]),
    (CheckpointManager, "_purge_stale_checkpoints", ["self"]),
    (OptimizersContainer, "_resolve_optimizer_factory", ["name"]),
    (OptimizersContainer, "_build_param_groups", ["model", "param_group_configs", "impl_kwargs"]),
    (BaseLoss, "_maybe_compile", ["self", "compile_config"]),
]  # fmt: skip


@pytest.mark.parametrize("owner, name, params", PRIVATE, ids=[n for _, n, _ in PRIVATE])
def test_private_callable_has_the_expected_signature(owner, name, params):
    fn = getattr(owner, name, None)
    assert callable(fn), f"{owner.__name__}.{name} is gone"
    assert _params(fn) == params, f"{owner.__name__}.{name}{inspect.signature(fn)}"


def test_our_overrides_match_what_they_override():
    for ours, base, name in [
        (LRAttnResCheckpointManager, CheckpointManager, "_purge_stale_checkpoints"),
        (MuonOptimizersContainer, OptimizersContainer, "_resolve_optimizer_factory"),
        (MuonOptimizersContainer, OptimizersContainer, "_build_param_groups"),
    ]:
        assert _params(getattr(ours, name)) == _params(getattr(base, name)), name


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"])
def test_schedules_we_run_take_our_additions(schedule):
    """``initialize_pp_stages`` calls ``_PipelineSchedule``'s: no schedule we support may
    override it (ours would then skip that override); and an instance of each takes our
    subclass (its ``step`` and ``_initialize_pp_stages`` passed through)."""
    cls = get_schedule_class(schedule)
    assert cls._initialize_pp_stages is _PipelineSchedule._initialize_pp_stages
    ours = pipeline._schedule_class(cls)
    assert _params(ours.step) == ["self", "args", "kwargs"]
    assert ours._initialize_pp_stages is not cls._initialize_pp_stages
    schedule_ = object.__new__(cls)
    pipeline._adopt(schedule_, pipeline.SourceCache(), None)
    assert isinstance(schedule_, cls) and type(schedule_) is not cls


def test_torchtitan_still_calls_the_hooks_we_extend():
    """Our checkpointer works inside torchtitan's save and load: they must still go through
    ``dcp_save`` / ``dcp_load`` and purge after an interval save; our optimizer and schedule
    hooks must still be what torchtitan and torch call."""
    save = inspect.getsource(CheckpointManager._save)
    assert "self.dcp_save(" in save and "self._purge_stale_checkpoints()" in save
    assert "self.dcp_save(" in inspect.getsource(CheckpointManager._save_last_step)
    assert "self.dcp_load(" in inspect.getsource(CheckpointManager._load)
    assert "self._resolve_optimizer_factory(" in inspect.getsource(OptimizersContainer.__init__)
    assert "self._build_param_groups(" in inspect.getsource(OptimizersContainer.__init__)
    # the schedule: eval runs through step, and both schedule kinds initialise through the hook
    assert "self.step(" in inspect.getsource(_PipelineSchedule.eval)
    for initialize in (PipelineScheduleSingle._initialize_stage,
                       PipelineScheduleMulti._initialize_stages):  # fmt: skip
        assert "self._initialize_pp_stages(" in inspect.getsource(initialize)


def test_a_save_now_is_torchtitans_save_with_interval_one_and_no_async():
    """``LRAttnResCheckpointManager.save_now`` sets ``interval`` and ``async_mode`` for one
    ``save``: torchtitan must still decide by them; and the trainer's preemption check is the
    loop's ``should_continue_training``, asked before each step."""
    should = inspect.getsource(CheckpointManager._should_save)
    assert "curr_step % self.interval == 0" in should
    assert "self.async_mode == AsyncMode.ASYNC" in inspect.getsource(CheckpointManager._save)
    assert "while self.should_continue_training():" in inspect.getsource(Trainer.train)


def test_skip_lm_head_is_set_by_the_trainer_and_read_by_the_model():
    assert Decoder._skip_lm_head is False
    assert "._skip_lm_head = True" in inspect.getsource(Trainer.__init__)


@pytest.mark.parametrize("name", cpu._NAME_BOUND)
def test_cpu_shim_finds_the_module_globals_it_sets(name):
    module = importlib.import_module(name)
    assert hasattr(module, "device_type") or hasattr(module, "device_module"), name


def test_cpu_shim_finds_torch_names():
    assert callable(torch._utils._get_available_device_type)
    from torch.distributed.fsdp import FSDPModule

    assert callable(FSDPModule.set_gradient_divide_factor)
    assert callable(FSDPModule.set_force_sum_reduction_for_comms)


# -- the wrappers do what their callers assume ---------------------------------------------------
def test_default_split_and_placement():
    assert internals.llm_module_names(2, 4, 1, 1) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "lm_head"],
    ]
    assert internals.stages_of_pp_rank(1, 2, "Interleaved1F1B", 4) == (1, 3)
    assert internals.stages_of_pp_rank(0, 2, "1F1B", 2) == (0,)


def test_stock_optimizers_and_loss_compile():
    assert internals.stock_optimizer_factory("AdamW") is torch.optim.AdamW
    with pytest.raises(NotImplementedError):
        internals.stock_optimizer_factory("Muon")  # ours: MuonOptimizersContainer adds it

    class Loss:
        fn = staticmethod(torch.add)

    loss = Loss()
    internals.compile_loss(loss, None)  # no --compile: untouched
    assert loss.fn is torch.add
