"""Parameter counts without allocating anything (`nnx.eval_shape`).

"Non-embedding" excludes the input embedding [V, D] and an untied output head
[D, V], as in the paper's (and the usual scaling-law) convention; it includes every
block (mixers, SwiGLU, norms, routers, LoRA, gates, convs) and the final norm.

"Active" counts the parameters one token uses: all of them, less the per-memory
weights of the routed memories a token is not routed to (MoM: N - k of its M = N (+1)
copies of W_k, W_v and the gates) and, for SSE with per-partition projections
(share_partition_params=False), the copies of W_q outside its read set and of
W_k / W_v outside its write set. SSE's routed partitions share their projections, so
an SSE layer with shared parameters is all active.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sse_jax.layers.mom import MoM, MoMConfig
from sse_jax.layers.sse import SSEConfig
from sse_jax.model.config import ModelConfig
from sse_jax.model.lm import LanguageModel


class ParamCount(NamedTuple):
  total: int
  embedding: int
  non_embedding: int
  active: int                 # used by one token (module docstring)
  active_non_embedding: int


def abstract_model(config: ModelConfig, param_dtype=jnp.float32) -> LanguageModel:
  """The model with ShapeDtypeStruct leaves: shapes only, nothing allocated."""
  return nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0),
                                              param_dtype=param_dtype))


def unused_copies(mixer, path: tuple) -> tuple[int, int]:
  """(copies a token does not use, copies) of the mixer parameter at `path` (inside the
  mixer), for a parameter stacked over routed copies; (0, 1) otherwise."""
  if isinstance(mixer, MoMConfig) and path[0] in MoM.PER_MEMORY:
    return mixer.num_memories - mixer.top_k, mixer.memories
  if isinstance(mixer, SSEConfig) and not mixer.share_partition_params and path[0] == "qkv":
    used = mixer.readers if path[1].startswith("q_") else mixer.writers
    return mixer.num_partitions - used, mixer.num_partitions + int(mixer.shared_partition)
  return 0, 1


def count_params(config: ModelConfig) -> ParamCount:
  model = abstract_model(config)
  sizes = jax.tree.map(lambda x: int(np.prod(x.shape)), nnx.state(model, nnx.Param))
  flat = [(path, int(v.get_value())) for path, v in nnx.to_flat_state(sizes)]
  total = sum(size for _, size in flat)
  embedding = sum(size for path, size in flat if path[0] in ("embed", "lm_head"))
  unused = 0
  for path, size in flat:
    if path[0] == "blocks" and path[2] == "mixer":
      skipped, copies = unused_copies(config.mixer_config(config.pattern[path[1]]), path[3:])
      unused += size // copies * skipped
  return ParamCount(total, embedding, total - embedding, total - unused,
                    total - embedding - unused)
