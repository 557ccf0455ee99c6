"""What the GLA and SSE mixers share: config fields, Q/K/V projections with the
optional short convolution, the output head, the recurrent cache.

Shapes: x [B, T, D]; H heads; Dk key/query dim and Dv value dim per head; P
per-partition copies of the projections (SSE with share_partition_params=False).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import validation as check
from sse_jax.layers.router import load_balance
from sse_jax.layers.features import ACTIVATIONS
from sse_jax.layers.mixer import MixerOutput
from sse_jax.layers.norm import RMSNorm
from sse_jax.layers.params import Einsum
from sse_jax.layers import sequences
from sse_jax.layers import short_conv
from sse_jax.layers.short_conv import ShortConv
from sse_jax.ops import checks
from sse_jax.ops import impl as impl_lib


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """Fields common to the GLA and SSE mixers (docs/design.md, section 2).

  hidden: D, the model width (divisible by num_heads).
  num_heads: H.
  key_dim / value_dim: Dk / Dv per head; None = D / H.
  query_activation / key_activation / value_activation: feature maps, one of
    "identity", "silu", "relu", "elu+1", "softmax", "topk-softmax" (see `features`).
  gate_rank / gate_normalizer: the low-rank decay gate,
    g = log_sigmoid(x W_1 W_2 + b) / gate_normalizer.
  short_conv: width w of the causal depthwise conv + SiLU on the q/k/v projections;
    0 = off (the paper), 4 in the official code.
  output_gate: y = (RMSNorm(o) * silu(x W_gate)) W_o if True, else RMSNorm(o) W_o.
  impl: the `sse_jax.ops` implementation (`allowed_impls`); a Pallas one also needs
    chunk_size and the head dims to be ones the kernels take (`pallas_error`, checked
    here; "auto" falls back to XLA where they do not).
  chunk_size: chunk length C of the chunked ops (a multiple of 16).
  norm_eps: epsilon of the per-head output RMSNorm.
  """

  hidden: int
  num_heads: int
  key_dim: int | None = None
  value_dim: int | None = None
  query_activation: str = "identity"
  key_activation: str = "identity"
  value_activation: str = "identity"
  gate_rank: int = 16
  gate_normalizer: float = 16.0
  short_conv: int = 0
  output_gate: bool = True
  impl: str = "chunk"
  chunk_size: int = 64
  norm_eps: float = 1e-6

  def __post_init__(self):
    self.validate()

  @property
  def head_k(self) -> int:
    return self.hidden // self.num_heads if self.key_dim is None else self.key_dim

  @property
  def head_v(self) -> int:
    return self.hidden // self.num_heads if self.value_dim is None else self.value_dim

  def allowed_impls(self) -> tuple[str, ...]:
    raise NotImplementedError

  def validate(self) -> None:
    name = type(self).__name__
    check.positive_int(name, "hidden", self.hidden)
    check.positive_int(name, "num_heads", self.num_heads)
    check.divides(name, "hidden", self.hidden, "num_heads", self.num_heads)
    check.optional_positive_int(name, "key_dim", self.key_dim)
    check.optional_positive_int(name, "value_dim", self.value_dim)
    for field in ("query_activation", "key_activation", "value_activation"):
      check.choice(name, field, getattr(self, field), ACTIVATIONS)
    check.positive_int(name, "gate_rank", self.gate_rank)
    check.positive_float(name, "gate_normalizer", self.gate_normalizer)
    check.nonnegative_int(name, "short_conv", self.short_conv)
    check.boolean(name, "output_gate", self.output_gate)
    check.choice(name, "impl", self.impl, self.allowed_impls())
    try:
      impl_lib.check_chunk_size(self.chunk_size)
    except ValueError as e:
      raise ValueError(f"{name}.{e}") from None
    error = self.pallas_error()
    if error:
      check.fail(name, "impl", self.impl, f"cannot take {error}")
    check.positive_float(name, "norm_eps", self.norm_eps)

  def kernel_op(self) -> str:
    """The op whose Pallas kernels this mixer's impl runs ("gla"; a delta-rule mixer
    says "gdn" or "sse_gdn"), for the kernels' shape limits (`pallas_error`)."""
    return "gla"

  def pallas_error(self) -> str | None:
    """Why the Pallas kernels cannot run this mixer's impl at its chunk size and head
    dims (one line naming the value), or None: fine, or an XLA impl, or "auto" (which
    checks the same when it resolves, and picks XLA instead). The limits are those of
    the kernels of `kernel_op`."""
    impl = checks.parse_enum(impl_lib.Impl, self.impl, "impl")
    if impl is impl_lib.Impl.AUTO:
      return None
    match impl_lib.named(impl).core:
      case impl_lib.PallasCore():
        return impl_lib.kernels_for(self.kernel_op()).shape_error(
            self.chunk_size, self.head_k, self.head_v)
      case _:
        return None


class RecurrentCache(NamedTuple):
  """Decoding cache of a linear-attention mixer (constant size in T).

  state: float32 recurrent state(s) in the layout the ops take (see each mixer).
  conv: (q, k, v) short-conv states [B, w - 1, ...], or None without short conv.
  """

  state: Any
  conv: tuple[jax.Array, jax.Array, jax.Array] | None


class QKV(nnx.Module):
  """x [B, T, D] -> q, k [B, T, (P,) H, Dk], v [B, T, (P,) H, Dv], after the optional
  short conv and before the feature maps; `copies` = P gives every partition its own
  kernels [D, P, H, Dk] (None: one shared set [D, H, Dk])."""

  def __init__(self, config: LinearAttentionConfig, *, copies: int | None = None,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    d, h = config.hidden, config.num_heads
    lead = () if copies is None else (copies,)
    names = () if copies is None else ("partitions",)
    eqn = "btd,dhk->bthk" if copies is None else "btd,dphk->btphk"
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    dims = {"q": config.head_k, "k": config.head_k, "v": config.head_v}
    for n, dim in dims.items():
      feat, feat_names = lead + (h, dim), names + ("heads", "head_dim")
      setattr(self, f"{n}_proj", Einsum(eqn, (d,) + feat, ("embed",) + feat_names, **kw))
      conv = (ShortConv(config.short_conv, feat, feat_names, **kw) if config.short_conv
              else None)
      setattr(self, f"{n}_conv", conv)

  def init_conv_state(self, batch: int):
    return short_conv.init_states((self.q_conv, self.k_conv, self.v_conv), batch)

  def __call__(self, x: jax.Array, conv_state=None, positions=None):
    """Returns (q, k, v, new conv state or None); `positions` int [T]: each token's
    position within its packed sequence (the short conv restarts at 0), or None."""
    outs = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
    ys, state = short_conv.apply_all((self.q_conv, self.k_conv, self.v_conv), outs,
                                     conv_state, positions)
    return (*ys, state)


class OutputHead(nnx.Module):
  """o [B, T, H, Dv], x [B, T, D] -> y = (RMSNorm_head(o) [* silu(x W_gate)]) W_o [B, T, D].

  The RMSNorm is per head over Dv with one scale [Dv] shared by the heads (fla's
  FusedRMSNormGated); the SiLU gate is the official `use_output_gate`.
  """

  def __init__(self, config: LinearAttentionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    d, h, dv = config.hidden, config.num_heads, config.head_v
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.norm = RMSNorm(dv, eps=config.norm_eps, names=("head_dim",), **kw)
    self.gate = (Einsum("btd,dhk->bthk", (d, h, dv), ("embed", "heads", "head_dim"), **kw)
                 if config.output_gate else None)
    self.proj = Einsum("bthk,hkd->btd", (h, dv, d), ("heads", "head_dim", "embed"), **kw)

  def __call__(self, o: jax.Array, x: jax.Array) -> jax.Array:
    o = self.norm(o)
    if self.gate is not None:
      o = o * jax.nn.silu(self.gate(x))
    return self.proj(o)


class LinearMixer(nnx.Module):
  """Skeleton of the GLA / SSE mixers: y = out(attend(x)).

  Subclasses define `attend(x, cache, cu_seqlens) -> (o [B, T, H, Dv], new cache or
  None, routing or None)` and `init_cache(batch)`.
  """

  def __call__(self, x: jax.Array, cache: RecurrentCache | None = None, *,
               cu_seqlens: jax.Array | None = None,
               token_mask: jax.Array | None = None) -> MixerOutput:
    """x [B, T, D] -> MixerOutput. Without a cache: the full sequence from a zero state.
    With a cache: continue from it (chunked prefill for T > 1, one decode step for
    T == 1) and return the updated cache. `cu_seqlens` int [S + 1] (B == 1, no cache):
    S packed sequences, each computed as if alone (see `sequences`). `token_mask`
    bool [B, T] (None: all): the tokens the load-balance loss and the usage statistics
    of a routed mixer average over (it changes nothing else)."""
    sequences.check(type(self).__name__, x, cu_seqlens, cache)
    o, cache, routing = self.attend(x, cache, cu_seqlens)
    y = self.out(o, x)
    if routing is None:
      return MixerOutput(y, cache)
    aux, usage = load_balance(routing.probs, routing.write_indices,
                              routing.probs.shape[-1], token_mask)
    return MixerOutput(y, cache, aux, usage, (routing.write_indices, routing.reads))

  def init_cache(self, batch: int, max_len: int | None = None) -> RecurrentCache:
    """A zero cache; `max_len` is ignored (the state does not grow with T)."""
    del max_len
    return RecurrentCache(self.zero_state(batch), self.qkv.init_conv_state(batch))
