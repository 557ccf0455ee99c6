"""What the diagnostics read from a model: each recurrent layer's final states, and the
keys, values and decays that built them.

    layers = trace(model, tokens)       # one LayerTrace per layer (None: attention)

The final states come from the model's own cache path (`init_cache`, then one call of
every block on the whole prompt: the chunked prefill that `sse_jax.generate` runs). The
keys, values, effective log decays and routing come from each mixer on the block's
normalised input: `GLA.inputs`, and for SSE its own submodules, combined the way
`SSE.attend` combines them; tests/test_diagnostics.py rebuilds the final states from them
with the plain recurrence to check that they are the ones the layer used.

Partition types: "gla" (a GLA mixer's one state per head), "routed" (an SSE layer's N
routed partitions) and "shared" (its shared partition).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sse_jax import ops
from sse_jax.layers import features
from sse_jax.layers.gla import GLA
from sse_jax.layers.sse import SSE
from sse_jax.ops.sse import make_routing, spread

TYPES = ("gla", "routed", "shared")


class LayerTrace(NamedTuple):
  """One recurrent layer on tokens [B, T], by partition type (the keys present).

  states:    gla / shared [B, H, Dk, Dv]; routed [B, N, H, Dk, Dv]: after the last token.
  keys:      gla / shared [B, T, H, Dk]; routed [B, T, Kw, H, Dk]: the (feature-mapped)
             key each token writes into each partition of its write set.
  values:    the same with Dv: the values written.
  log_decay: gla / shared [B, T, H, Dk]; routed [B, T, N, H, Dk]: the log decay each
             state row takes at each step (0 for a routed partition the token does not
             write, and for the rows a row-sparse GLA key leaves alone).
  write_weights: routed only, [B, T, Kw]: the weight w of each write (1 when the gate
             placement leaves the write ungated).
  write_indices / read_indices: routed only, int32 [B, T, Kw] / [B, T, Kr].
  """

  states: dict
  keys: dict
  values: dict
  log_decay: dict
  write_weights: jax.Array | None = None
  write_indices: jax.Array | None = None
  read_indices: jax.Array | None = None


def _gla(mixer: GLA, x: jax.Array, state) -> LayerTrace:
  _, k, v, g, _ = mixer.inputs(x)
  return LayerTrace({"gla": state}, {"gla": k}, {"gla": v}, {"gla": g})


def _sse(mixer: SSE, x: jax.Array, state) -> LayerTrace:
  c = mixer.config
  n, shared = c.num_partitions, c.shared_partition
  key = lambda z: features.activate(c.key_activation, z)
  _, k, v, _ = mixer.qkv(x)
  v = features.activate(c.value_activation, v)
  routing = mixer.router(x)
  r = make_routing(routing.write_weights, routing.write_indices, routing.read_weights,
                   routing.read_indices, ops.Gate(c.gate_placement))
  written, _ = spread(r.write_idx, r.write_w, n)                        # [B, T, N]
  g = mixer.decay(x)
  g0 = g if mixer.shared_decay is None else mixer.shared_decay(x)
  slots = r.write_idx[..., None, None]                                  # [B, T, Kw, 1, 1]
  if c.share_partition_params:
    k_r = k0 = key(k)
    if mixer.lora_k is not None:
      adapted = key(k + mixer.lora_k(x))
      if c.lora_target == "shared":
        k0 = adapted
      else:
        k_r = adapted
    kw = r.write_idx.shape[-1]
    k_r, v_r = (jnp.repeat(z[:, :, None], kw, axis=2) for z in (k_r, v))
    routed = state[0] if shared else state
    shared_state = state[1] if shared else None
  else:  # per-partition projections [B, T, P, H, D], slot N the shared partition
    k_r = jnp.take_along_axis(key(k[:, :, :n]), slots, axis=2)
    v_r = jnp.take_along_axis(v[:, :, :n], slots, axis=2)
    if shared:
      k0, v = key(k[:, :, n]), v[:, :, n]
    b, ph = state.shape[:2]
    folded = state.reshape((b, ph // c.num_heads, c.num_heads) + state.shape[2:])
    routed = folded[:, :n]
    shared_state = folded[:, n] if shared else None
  out = LayerTrace({"routed": routed}, {"routed": k_r}, {"routed": v_r},
                   {"routed": g[:, :, None] * written[..., None, None]},
                   r.write_w, r.write_idx, r.read_idx)
  if shared:
    for field, value in (("states", shared_state), ("keys", k0), ("values", v),
                         ("log_decay", g0)):
      getattr(out, field)["shared"] = value
  return out


def trace(model, tokens: jax.Array) -> list[LayerTrace | None]:
  """tokens int [B, T] -> per layer of `model` (a `LanguageModel`), its LayerTrace, or
  None for an attention layer. Jit it with the model split (`nnx.split`) for speed."""
  b, t = tokens.shape
  x = jnp.take(model.embed[...], tokens, axis=0).astype(model.dtype)
  out = []
  for block, cache in zip(model.blocks, model.init_cache(b, t)):
    mixer = block.mixer
    h = block.mixer_norm(x)
    step = block(x, cache)
    x = step.y
    if isinstance(mixer, GLA):
      out.append(_gla(mixer, h, step.cache.state))
    elif isinstance(mixer, SSE):
      out.append(_sse(mixer, h, step.cache.state))
    else:
      out.append(None)
  return out
