"""Parameter counts without allocating anything (`nnx.eval_shape`).

"Non-embedding" excludes the input embedding [V, D] and an untied output head
[D, V], as in the paper's (and the usual scaling-law) convention; it includes every
block (mixers, SwiGLU, norms, routers, LoRA, gates, convs) and the final norm.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sse_jax.model.config import ModelConfig
from sse_jax.model.lm import LanguageModel


class ParamCount(NamedTuple):
  total: int
  embedding: int
  non_embedding: int


def abstract_model(config: ModelConfig, param_dtype=jnp.float32) -> LanguageModel:
  """The model with ShapeDtypeStruct leaves: shapes only, nothing allocated."""
  return nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0),
                                              param_dtype=param_dtype))


def count_params(config: ModelConfig) -> ParamCount:
  model = abstract_model(config)
  sizes = jax.tree.map(lambda x: int(np.prod(x.shape)), nnx.state(model, nnx.Param))
  flat = nnx.to_flat_state(sizes)
  total = sum(int(v.get_value()) for _, v in flat)
  embedding = sum(int(v.get_value()) for path, v in flat if path[0] in ("embed", "lm_head"))
  return ParamCount(total, embedding, total - embedding)
