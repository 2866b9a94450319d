"""Float8 training (torchao rowwise) for this model, as a torchtitan model-config converter.

torchtitan 0.3.0's ``Float8LinearConverter`` has three traps here:
``emulate=True`` silently switches the recipe to tensorwise, ``filter_fqns=
["auto_filter_small_kn"]`` converts nothing (torchao's filter gets a config, not a module), and
the hardware check runs when the config is built, so a GPU config cannot even be built on a CPU
machine. :class:`Float8Rowwise` keeps the recipe (``dataclasses.replace(..., emulate=True)`` for
CPU tests), checks the hardware when the model is built, not when the config is, and skips:

- ``lm_head``: the logits (and the z-loss's logsumexp) are the most precision-sensitive matmul,
  and cl100k's 100,277 rows are not a multiple of 16 anyway;
- ``embedding_key``: the embedding's key projection (``d -> r``, projected variant) feeds the
  routing softmax and is tiny;
- every Linear with a dimension not divisible by 16 (float8 GEMM requirement).

Converted: every attention / MLP projection of every layer (``layers.{i}.attention``'s
``qkv_linear.wqkv`` and ``wo``, ``layers.{i}.feed_forward``'s ``w1``, ``w2``, ``w3``), the fused
``[W^O; W^K]`` of ``wo`` and ``w2`` included (one GEMM; the key is split from its output).
There is no float8 all-gather in torchtitan 0.3.0 (and torchao offers it for tensorwise only):
FSDP2 gathers the high-precision weights and casts after.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torchtitan.components.quantization import Float8Linear, QuantizationConverter
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.models.common.linear import Linear
from torchtitan.tools.logging import logger

FLOAT8_SKIP = ["lm_head", "embedding_key"]


def check_float8_hardware(emulate: bool) -> None:
    """Raise unless float8 GEMMs can run here (NVIDIA SM89+), or ``emulate``."""
    if emulate:
        return
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise RuntimeError(
            "float8 training needs an NVIDIA GPU with SM89+ (H100 / H200); "
            "use a config without float8 here"
        )


if Float8Linear is not None:  # None without torchao: the converter refuses when built

    @dataclass(kw_only=True, slots=True)
    class Float8LinearConfig(Float8Linear.Config):
        """torchtitan's ``Float8Linear.Config`` that checks the hardware when the layer is
        built."""

        def build(self, **kwargs):
            check_float8_hardware(self._torchao_config.emulate)
            return Float8Linear.Config.build(self, **kwargs)


class Float8Rowwise(QuantizationConverter):
    """Swap matching ``Linear.Config`` for torchao's ``Float8Linear`` (``recipe_name``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: str = "rowwise"
        """torchao recipe: "rowwise" or "rowwise_with_gw_hp"."""

        filter_fqns: list[str] = field(default_factory=lambda: list(FLOAT8_SKIP))
        """Modules whose FQN contains one of these stay in high precision."""

        emulate: bool = False
        """Emulated float8 matmuls (CPU tests; refused with compile), same recipe."""

    def __init__(self, config: Config):
        if Float8Linear is None:
            raise ImportError("float8 training needs torchao (pip install torchao==0.18.0)")
        from torchao.float8 import Float8LinearConfig as TorchAOConfig

        if config.emulate and config.model_compile_enabled:
            raise ValueError("float8 emulation does not run under torch.compile")
        self.config = config
        recipe = TorchAOConfig.from_recipe_name(config.recipe_name)
        self.torchao_config = dataclasses.replace(recipe, emulate=config.emulate)
        self.converted: list[str] = []
        self.skipped: list[str] = []
        if config.recipe_name.startswith("rowwise"):  # as torchtitan (pytorch#150859)
            torch._inductor.config.emulate_precision_casts = True

    def convert(self, model_config):
        for fqn, linear, parent, attr in model_config.traverse(Linear.Config):
            if not module_filter_fn(linear, fqn, self.config.filter_fqns):
                self.skipped.append(fqn)
                continue
            new = Float8LinearConfig(
                in_features=linear.in_features,
                out_features=linear.out_features,
                bias=linear.bias,
                param_init=linear.param_init,
                _torchao_config=self.torchao_config,
            )
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.converted.append(fqn)
        logger.info(
            f"float8 {self.config.recipe_name}: {len(self.converted)} Linear layers converted, "
            f"{len(self.skipped)} kept in high precision ({', '.join(self.skipped)})"
        )
        return model_config
