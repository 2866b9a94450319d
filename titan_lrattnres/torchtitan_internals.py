"""Every call of a private torchtitan (or torch pipelining) name the package makes, one small
function each, written for torchtitan 0.3.0 (``titan_lrattnres.training.cpu.TORCHTITAN_VERSION``).

Everything else goes through torchtitan's extension points: components built from config
subclasses (``LRAttnResCheckpointManager``, ``RunMetricsProcessor``, ``ZLossMetricsProcessor``,
``EndValidator``, ``MuonOptimizersContainer``) and public methods. What is here has no public
route; ``tests/titan_lrattnres/training/test_torchtitan_internals.py`` checks each name and
signature, so an upgrade that changes one fails there by name instead of changing a run quietly.

Called here (and nowhere else):

- ``torchtitan.distributed.pipeline_parallel._get_pipeline_metadata``,
  ``._generate_llm_fqn_per_model_part``, ``._get_pp_rank_to_stage_indices_mapping``: the stage
  split and placement ``pipeline_llm`` will make, which the stage plans need before it runs
  (``titan_lrattnres.parallel.pipeline``);
- torch's ``_PipelineSchedule._initialize_pp_stages``: the first-step shape inference, which
  also calls the loss (``titan_lrattnres.parallel.pipeline``);
- ``CheckpointManager._purge_stale_checkpoints``: the stock purge, run once the newest save is
  recorded (``titan_lrattnres.components.checkpoint``);
- ``OptimizersContainer._resolve_optimizer_factory``: the stock optimizers beside Muon
  (``titan_lrattnres.components.optimizers``);
- ``BaseLoss._maybe_compile``: ``--compile`` of a leaf loss (``titan_lrattnres.components.zloss``).

Overridden by our subclasses (torchtitan or torch calls them by name):
``_PipelineSchedule._initialize_pp_stages`` (parallel/pipeline.py),
``CheckpointManager._purge_stale_checkpoints`` (components/checkpoint.py),
``OptimizersContainer._resolve_optimizer_factory`` and ``._build_param_groups``
(components/optimizers.py). Read: ``Decoder._skip_lm_head``, which torchtitan's Trainer sets on
the model (model/model.py, parallel/pipeline.py).

Set on purpose by ``titan_lrattnres.training.cpu`` (CPU only, left there: it must run before
torchtitan is imported): ``torch._utils._get_available_device_type``, and the module globals
``device_type`` / ``device_module`` / ``_get_available_device_type`` of the modules in
``cpu._NAME_BOUND``; ``FSDPModule.set_gradient_divide_factor`` (public) is wrapped.
"""

from __future__ import annotations

from typing import Any


# -- pipeline parallel: the split pipeline_llm will make ------------------------------------------
def pipeline_metadata(parallel_dims, parallelism, model_config) -> tuple[int, int, int, int]:
    """``(stages, layers, input_weight, output_weight)`` as ``pipeline_llm`` derives them."""
    from torchtitan.distributed import pipeline_parallel as pp

    return pp._get_pipeline_metadata(parallel_dims, parallelism, model_config)


def llm_module_names(
    stages: int, layers: int, input_weight: int, output_weight: int
) -> list[list[str]]:
    """The module names of each stage in ``pipeline_llm``'s default split."""
    from torchtitan.distributed import pipeline_parallel as pp

    return pp._generate_llm_fqn_per_model_part(stages, layers, input_weight, output_weight)


def stages_of_pp_rank(pp_rank: int, pp_degree: int, schedule: str, stages: int) -> tuple:
    """The indices of the stages ``pipeline_llm`` places on pipeline rank ``pp_rank``."""
    from torchtitan.distributed import pipeline_parallel as pp

    return pp._get_pp_rank_to_stage_indices_mapping(pp_rank, pp_degree, schedule, stages)


def initialize_pp_stages(schedule, *args: Any, **kwargs: Any):
    """torch's own ``_initialize_pp_stages`` of ``schedule``, for an override that wraps it."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return _PipelineSchedule._initialize_pp_stages(schedule, *args, **kwargs)


# -- components ---------------------------------------------------------------------------------
def purge_stale_checkpoints(manager) -> None:
    """torchtitan's own purge of the step folders beyond ``keep_latest_k`` (rank 0 queues them)."""
    from torchtitan.components.checkpointer import CheckpointManager

    CheckpointManager._purge_stale_checkpoints(manager)


def stock_optimizer_factory(name: str):
    """The optimizer class torchtitan's ``OptimizersContainer`` builds for ``name``."""
    from torchtitan.components.optimizer import OptimizersContainer

    return OptimizersContainer._resolve_optimizer_factory(name)


def compile_loss(loss, compile_config) -> None:
    """Compile ``loss.fn`` when ``--compile`` covers the loss, as torchtitan's own losses do."""
    from torchtitan.components.loss import BaseLoss

    BaseLoss._maybe_compile(loss, compile_config)
