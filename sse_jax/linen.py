"""Flax Linen wrappers of the NNX layers and the language model (`nnx.bridge`).

    import flax.linen as nn
    from sse_jax import linen as sse_linen

    class Net(nn.Module):
      config: SSEConfig

      @nn.compact
      def __call__(self, x):                       # x [B, T, D]
        out = sse_linen.sse_layer(self.config, name="sse")(x)   # MixerOutput
        return nn.Dense(10)(out.y), out.aux_loss

Parameters live in the Linen "params" collection, boxed in `nnx.bridge.NNXMeta`
that carries the logical axis names (`nn.get_partition_spec` reads them;
`nn.meta.unbox` gives plain arrays). Each wrapper returns a Linen module whose call
signature and outputs are those of the NNX module: mixers take (x [B, T, D],
cache=None, *, cu_seqlens=None) and return `MixerOutput`; the model takes tokens
[B, T] (and `cache=` or, for packed sequences, `cu_seqlens=`) and returns
`ModelOutput`. Initialisation needs a "params" rng. Other methods of the
NNX module are reached with `nnx_method`, e.g. the decoding cache, then one step:

    cache = lm.apply(variables, batch, max_len, nnx_method="init_cache")
    out = lm.apply(variables, tokens[:, t:t + 1], cache=cache)   # out.cache: the next
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers.attention import Attention, AttentionConfig
from sse_jax.layers.gdn import GDN, GDNConfig
from sse_jax.layers.gla import GLA, GLAConfig
from sse_jax.layers.mom import MoM, MoMConfig
from sse_jax.layers.sse import SSE, SSEConfig
from sse_jax.layers.swa import SlidingWindowAttention, SWAConfig
from sse_jax.model.config import ModelConfig
from sse_jax.model.lm import LanguageModel


def wrap(nnx_class: type[nnx.Module], config: Any, *, dtype=jnp.float32,
         param_dtype=jnp.float32, name: str | None = None) -> nn.Module:
  """A Linen module running `nnx_class(config, rngs=..., dtype=..., param_dtype=...)`."""
  return nnx.bridge.to_linen(nnx_class, config, dtype=dtype, param_dtype=param_dtype,
                             name=name)


def sse_layer(config: SSEConfig, **kwargs) -> nn.Module:
  """The SSE mixer: x [B, T, D] -> MixerOutput(y, cache, aux_loss, usage)."""
  return wrap(SSE, config, **kwargs)


def gla_layer(config: GLAConfig, **kwargs) -> nn.Module:
  """The GLA mixer: x [B, T, D] -> MixerOutput(y, cache)."""
  return wrap(GLA, config, **kwargs)


def gdn_layer(config: GDNConfig, **kwargs) -> nn.Module:
  """The Gated DeltaNet mixer: x [B, T, D] -> MixerOutput(y, cache)."""
  return wrap(GDN, config, **kwargs)


def mom_layer(config: MoMConfig, **kwargs) -> nn.Module:
  """The Mixture-of-Memories mixer: x [B, T, D] -> MixerOutput(y, cache, aux_loss,
  usage)."""
  return wrap(MoM, config, **kwargs)


def attention_layer(config: AttentionConfig, **kwargs) -> nn.Module:
  """The attention mixer: x [B, T, D] -> MixerOutput(y, cache)."""
  return wrap(Attention, config, **kwargs)


def swa_layer(config: SWAConfig, **kwargs) -> nn.Module:
  """Sliding-window attention: x [B, T, D] -> MixerOutput(y, cache)."""
  return wrap(SlidingWindowAttention, config, **kwargs)


def language_model(config: ModelConfig, **kwargs) -> nn.Module:
  """The language model: tokens [B, T] -> ModelOutput(logits float32 [B, T, V], ...)."""
  return wrap(LanguageModel, config, **kwargs)
