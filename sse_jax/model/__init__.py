"""The language model: config, module, presets, parameter counts.

    from sse_jax.model import LanguageModel, presets
    model = LanguageModel(presets.paper_600m("sse"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    out = model(tokens)            # ModelOutput(logits, aux_loss, router_usage, ...)
"""

from sse_jax.model import presets
from sse_jax.model.config import MIXERS, ModelConfig, hybrid_pattern
from sse_jax.model.counting import ParamCount, abstract_model, count_params
from sse_jax.model.lm import LanguageModel, ModelOutput
from sse_jax.model.presets import preset

__all__ = ["MIXERS", "LanguageModel", "ModelConfig", "ModelOutput", "ParamCount",
           "abstract_model", "count_params", "hybrid_pattern", "preset", "presets"]
