"""Flax NNX layers: the SSE, GLA, GDN and MoM linear-attention mixers, softmax attention
(full or sliding-window), SwiGLU, RMSNorm and the pre-norm block (shapes [B, T, D]
throughout).

    from sse_jax.layers import SSE, SSEConfig
    layer = SSE(SSEConfig(hidden=256, num_heads=4), rngs=nnx.Rngs(0))
    out = layer(x)                 # MixerOutput(y, cache, aux_loss, usage)
    out = layer(x_packed, cu_seqlens=cu)   # S sequences packed in x [1, T, D]
"""

from sse_jax.layers.attention import Attention, AttentionConfig, KVCache
from sse_jax.layers.block import Block, MixerConfig, REMAT_POLICIES, make_mixer
from sse_jax.layers.features import ACTIVATIONS, activate
from sse_jax.layers.gdn import GDN, GDNConfig
from sse_jax.layers.gla import GLA, GLAConfig
from sse_jax.layers.linear import LinearAttentionConfig, RecurrentCache
from sse_jax.layers.lowrank import DecayGate, LowRank
from sse_jax.layers.mixer import MixerOutput
from sse_jax.layers.mlp import MLPConfig, SwiGLU
from sse_jax.layers.mom import MoM, MoMConfig
from sse_jax.layers.norm import RMSNorm
from sse_jax.layers.params import LOGICAL_AXIS_RULES, Einsum
from sse_jax.layers.rope import apply_rope
from sse_jax.layers.router import Router, Routing, load_balance
from sse_jax.layers import sequences
from sse_jax.layers.short_conv import ShortConv
from sse_jax.layers.sse import SSE, SSEConfig
from sse_jax.layers.swa import RingCache, SWAConfig, SlidingWindowAttention

__all__ = [
    "ACTIVATIONS", "Attention", "AttentionConfig", "Block", "DecayGate", "Einsum", "GDN",
    "GDNConfig", "GLA", "GLAConfig", "KVCache", "LOGICAL_AXIS_RULES",
    "LinearAttentionConfig", "LowRank", "MLPConfig", "MixerConfig", "MixerOutput", "MoM", "MoMConfig", "REMAT_POLICIES",
    "RMSNorm", "RecurrentCache", "RingCache", "Router", "Routing", "SSE", "SSEConfig",
    "SWAConfig", "ShortConv", "SlidingWindowAttention", "SwiGLU", "activate",
    "apply_rope", "load_balance", "make_mixer", "sequences",
]
