"""Hugging Face transformers format of LR-AttnRes models (``--format hf``; docs/evaluation.md).

``configuration_lrattnres.py`` and ``modeling_lrattnres.py`` are the remote code copied into
every exported folder (torch and transformers only); ``convert`` maps the project's model onto
them. Importing this package also registers the classes with the Auto* factories, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works without ``trust_remote_code`` where the
package is installed. Needs ``transformers`` (a ``dev`` extra).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from titan_lrattnres.evaluation.hf.configuration_lrattnres import LRAttnResConfig
from titan_lrattnres.evaluation.hf.convert import convert_state_dict, export_hf, hf_config, to_hf
from titan_lrattnres.evaluation.hf.modeling_lrattnres import (
    LRAttnResForCausalLM,
    LRAttnResModel,
    LRAttnResPreTrainedModel,
)


def register() -> None:
    """Register ``model_type="lrattnres"`` with AutoConfig, AutoModel, AutoModelForCausalLM."""
    AutoConfig.register(LRAttnResConfig.model_type, LRAttnResConfig, exist_ok=True)
    AutoModel.register(LRAttnResConfig, LRAttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(LRAttnResConfig, LRAttnResForCausalLM, exist_ok=True)


register()

__all__ = [
    "LRAttnResConfig",
    "LRAttnResForCausalLM",
    "LRAttnResModel",
    "LRAttnResPreTrainedModel",
    "convert_state_dict",
    "export_hf",
    "hf_config",
    "register",
    "to_hf",
]
