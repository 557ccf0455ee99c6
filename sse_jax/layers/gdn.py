"""The GDN mixer: Gated DeltaNet, the official layer's parameterisation (docs/design.md,
section 7).

For x [B, T, D], H heads with key dim Dk and value dim Dv:

    q = l2norm(phi_q(conv(x W_q))),  k = l2norm(phi_k(conv(x W_k)))   [B, T, H, Dk]
    v = phi_v(conv(x W_v))                                              [B, T, H, Dv]
    g    = -exp(A_log) softplus(x W_a + dt_bias)                        [B, T, H], <= 0
    beta = sigmoid(x W_b)   (x 2 with allow_neg_eigval)                 [B, T, H]
    S'_t = exp(g_t) S_{t-1},   S_t = S'_t + beta_t k_t^T (v_t - k_t S'_t)   (ops.gdn)
    o_t  = Dk^-1/2 q_t S_t
    y = (RMSNorm_head(o) * silu(x W_gate)) W_o                          [B, T, D]

conv is the width-w causal depthwise convolution + SiLU (`short_conv`, 4 by default as
in the official layer); its SiLU is the official layer's SiLU on q, k and v, so the
feature maps phi default to the identity. Without the conv (short_conv = 0) the official
layer applies SiLU directly: set query/key/value_activation="silu" to match it. The L2
normalisation (eps 1e-6, in float32) keeps every key a unit vector, so with beta in
[0, 1] ([0, 2]) the transition's eigenvalues lie in [0, 1] ([-1, 1]).

Packed sequences (`cu_seqlens`) restart the state and the short conv at every sequence
start. Cache (`init_cache`): RecurrentCache(state float32 [B, H, Dk, Dv], conv states).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax import ops
from sse_jax.layers import features
from sse_jax.layers import sequences
from sse_jax.layers import validation as check
from sse_jax.layers.delta import DeltaGates, check_unused_gla_gate, l2_normalize
from sse_jax.layers.linear import LinearAttentionConfig, LinearMixer, OutputHead, QKV
from sse_jax.layers.linear import RecurrentCache


@dataclasses.dataclass(frozen=True)
class GDNConfig(LinearAttentionConfig):
  """GDN mixer config: the `LinearAttentionConfig` fields (the GLA decay gate's
  gate_rank / gate_normalizer do not apply and must stay at their defaults) plus

  allow_neg_eigval: beta = 2 sigmoid(x W_b) in [0, 2] (negative eigenvalues).
  Defaults: short_conv 4 (the official layer), impl "chunk" (one of `ops.GDN_IMPLS`).
  """

  short_conv: int = 4
  impl: str = "chunk"
  allow_neg_eigval: bool = False

  def kernel_op(self) -> str:
    return "gdn"

  def allowed_impls(self) -> tuple[str, ...]:
    return tuple(ops.GDN_IMPLS)

  def validate(self) -> None:
    super().validate()
    check.boolean("GDNConfig", "allow_neg_eigval", self.allow_neg_eigval)
    check_unused_gla_gate("GDNConfig", self, "to the GDN mixer")


def run_gdn(q, k, v, g, beta, state, *, impl: str, chunk_size: int, decode: bool,
            cu_seqlens=None):
  """ops.gdn over [B, T, H, D] inputs (g, beta [B, T, H]; packed sequences with
  `cu_seqlens`), or one decode step when `decode` (T == 1). `state` None: a fresh
  sequence, no final state returned. Returns (o, state or None)."""
  if decode:
    o, state = ops.gdn_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    return o[:, None], state
  return ops.gdn(q, k, v, g, beta, initial_state=state,
                 output_final_state=state is not None, cu_seqlens=cu_seqlens, impl=impl,
                 chunk_size=chunk_size)


class GDN(LinearMixer):
  """GDN mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache). Module docstring for the
  equations; the gates and the recurrent state are float32 whatever `dtype`."""

  def __init__(self, config: GDNConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    c = config
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.qkv = QKV(c, **kw)
    self.gates = DeltaGates(c.hidden, c.num_heads, allow_neg_eigval=c.allow_neg_eigval,
                            **kw)
    self.out = OutputHead(c, **kw)

  def zero_state(self, batch: int) -> jax.Array:
    c = self.config
    return jnp.zeros((batch, c.num_heads, c.head_k, c.head_v), jnp.float32)

  def inputs(self, x: jax.Array, conv_state=None, positions=None):
    """x [B, T, D] -> (q, k [B, T, H, Dk] L2-normalised, v [B, T, H, Dv], g, beta
    [B, T, H] float32, the new conv state or None): what the recurrence reads."""
    c = self.config
    q, k, v, conv = self.qkv(x, conv_state, positions)
    q = l2_normalize(features.activate(c.query_activation, q))
    k = l2_normalize(features.activate(c.key_activation, k))
    v = features.activate(c.value_activation, v)
    g, beta = self.gates(x)
    return q, k, v, g, beta, conv

  def attend(self, x: jax.Array, cache: RecurrentCache | None = None, cu_seqlens=None):
    """x [B, T, D] -> (o [B, T, H, Dv] before the output head, the updated cache or
    None, None: no routing)."""
    c = self.config
    q, k, v, g, beta, conv = self.inputs(
        x, None if cache is None else cache.conv,
        sequences.positions_or_none(cu_seqlens, x.shape[1]))
    o, state = run_gdn(q, k, v, g, beta, None if cache is None else cache.state,
                       impl=c.impl, chunk_size=c.chunk_size,
                       decode=cache is not None and x.shape[1] == 1, cu_seqlens=cu_seqlens)
    return o, (None if cache is None else RecurrentCache(state, conv)), None
