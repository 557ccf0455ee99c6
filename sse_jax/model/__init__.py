"""The language model: config, module, presets, parameter counts."""

from sse_jax.model.config import MIXERS, ModelConfig, hybrid_pattern
from sse_jax.model.counting import ParamCount, abstract_model, count_params
from sse_jax.model.lm import LanguageModel, ModelOutput

__all__ = ["MIXERS", "LanguageModel", "ModelConfig", "ModelOutput", "ParamCount",
           "abstract_model", "count_params", "hybrid_pattern"]
