"""The SSE mixer with transition="delta" (SSE-GDN) against its equations written directly
in float64 on top of `ops.sse_gdn`'s scan reference (outputs and parameter gradients,
router included) over the knobs that apply: impls, gate placements, separate read sets,
the shared partition with its LoRA on either side and its own gates, feature maps,
negative eigenvalues; packed sequences, prefill + decode, and the one-line errors for
the knobs that do not apply."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax import ops
from sse_jax.layers import SSE, SSEConfig
from sse_jax.layers.testing import random_module
from tests.op_testing import assert_close, x64
from tests.test_layers_gdn import (ACT, B, D, H, T, TOL, cached_pieces, call,
                                   check_against_reference, check_margin, delta_gates,
                                   float64_params, gentle_decays, l2, output_head,
                                   project, reference_and_grads)
from tests.test_layers_gdn import _full_float32_matmuls  # noqa: F401  (autouse fixture)

BASE = SSEConfig(hidden=D, num_heads=H, transition="delta", num_partitions=4, top_k=2,
                 short_conv=4, lora_rank=8, chunk_size=16)
CASES = {
    "varlen_lora_shared_gate_both": BASE,
    "masking_lora_routed_write_gate_3_readers_neg_eigval": dataclasses.replace(
        BASE, impl="masking", lora_target="routed", gate_placement="write",
        num_readers=3, allow_neg_eigval=True, query_activation="silu",
        key_activation="silu"),
    "scan_no_shared_read_gate_top1": dataclasses.replace(
        BASE, impl="scan", shared_partition=False, gate_placement="read", top_k=1,
        short_conv=0, key_activation="silu", value_activation="silu"),
    "varlen_gate_none_all_partitions": dataclasses.replace(
        BASE, gate_placement="none", top_k=4, lora_rank=0, key_dim=8, value_dim=12),
}


def make(cfg, seed=3):
  layer = random_module(lambda: SSE(cfg, rngs=nnx.Rngs(0)), seed)
  gentle_decays(layer, seed)
  return layer


def sse_gdn_reference(p, x, c):
  """SSE-GDN (sse_jax.layers.sse's docstring) in float64 on ops.sse_gdn's scan."""
  probs = jax.nn.softmax(x @ p["router"]["kernel"], axis=-1)

  def top(k):  # weights not renormalised; ties to the lower index
    idx = jnp.argsort(-probs, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(probs, idx, axis=-1), idx.astype(jnp.int32)

  w, idx = top(c.writers)
  rw, ri = top(c.readers) if c.readers != c.writers else (None, None)
  conv = c.short_conv > 0
  q, k = project(p, x, "q", conv), project(p, x, "k", conv)
  v = ACT[c.value_activation](project(p, x, "v", conv))
  qa, ka = ACT[c.query_activation], ACT[c.key_activation]
  q_r, k_r = qa(q), ka(k)
  g, beta = delta_gates(p["decay"], x, c.allow_neg_eigval)
  shared = None
  if c.shared_partition:
    q0, k0 = q_r, k_r
    if c.lora_rank:
      lora = lambda n: jnp.einsum("btr,rhk->bthk", x @ p[n]["down"]["kernel"],
                                  p[n]["up"]["kernel"])
      adapted = qa(q + lora("lora_q")), ka(k + lora("lora_k"))
      if c.lora_target == "shared":
        q0, k0 = adapted
      else:
        q_r, k_r = adapted
    g0, b0 = (delta_gates(p["shared_decay"], x, c.allow_neg_eigval)
              if c.lora_target == "routed" else (g, beta))
    shared = (l2(q0), l2(k0), g0, b0)
  o, _ = ops.sse_gdn(l2(q_r), l2(k_r), v, g, beta, w, idx,
                     num_partitions=c.num_partitions, gate=c.gate_placement, impl="scan",
                     shared=shared, read_weights=rw, read_indices=ri)
  return output_head(p["out"], o, x, c)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sse_gdn_matches_the_float64_reference_with_gradients(case):
  cfg = CASES[case]
  grads = check_against_reference(make(cfg), lambda p, x: sse_gdn_reference(p, x, cfg),
                                  0, case)
  # The router weight acts (write strength / output weight) unless the gate is "none",
  # where the task loss cannot reach the router at all.
  router = np.abs(grads["router"]["kernel"]).max()
  assert (router == 0) if cfg.gate_placement == "none" else (router > 1e-6), router
  assert np.abs(grads["decay"]["b_proj"]["kernel"]).max() > 0


CU = np.array([0, 1, 1, 9, 21], np.int32)  # lengths 1, 0, 8, 12


def test_packed_sequences_equal_separate_sequences():
  cfg = CASES["masking_lora_routed_write_gate_3_readers_neg_eigval"]
  layer = make(cfg, seed=5)
  x = jax.random.normal(jax.random.key(6), (1, T, D))
  check_margin(layer, x)
  got = call(layer, x, cu_seqlens=jnp.asarray(CU)).y
  with x64():
    p = float64_params(layer)
  for a, b in ((0, 1), (1, 9), (9, 21)):
    want, _ = reference_and_grads(lambda p, x: sse_gdn_reference(p, x, cfg), p,
                                  x[:, a:b], jnp.zeros((1, b - a, D)))
    assert_close(got[:, a:b], want, TOL, f"{a}:{b}")


@pytest.mark.parametrize("case", ["varlen_lora_shared_gate_both",
                                  "masking_lora_routed_write_gate_3_readers_neg_eigval",
                                  "scan_no_shared_read_gate_top1"])
def test_prefill_and_decode_equal_the_full_call(case):
  cfg = CASES[case]
  layer = make(cfg)
  x = jax.random.normal(jax.random.key(4), (B, T, D))
  check_margin(layer, x)
  y, cache = cached_pieces(layer, x)
  assert_close(y, call(layer, x).y, TOL, case)
  routed = cache.state[0] if cfg.shared_partition else cache.state
  assert routed.shape == (B, cfg.num_partitions, H, cfg.head_k, cfg.head_v)


def test_knobs_that_cannot_apply_to_delta_are_refused():
  with pytest.raises(ValueError, match=r"^SSEConfig.transition='rwkv' is not one of "
                     r"'gla', 'delta'$"):
    dataclasses.replace(BASE, transition="rwkv")
  with pytest.raises(ValueError, match=r"^SSEConfig.share_partition_params=False is not "
                     r"available with transition='delta'"):
    dataclasses.replace(BASE, share_partition_params=False)
  for field, value in (("gate_rank", 8), ("gate_normalizer", 4.0)):
    with pytest.raises(ValueError, match=rf"^SSEConfig.{field}={value!r} does not apply "
                       r"to transition='delta'"):
      dataclasses.replace(BASE, **{field: value})
  with pytest.raises(ValueError, match=r"^SSEConfig.impl='loop' is not one of"):
    dataclasses.replace(BASE, impl="loop")
  with pytest.raises(ValueError, match=r"^SSEConfig.allow_neg_eigval=True applies to "
                     r"transition='delta' only$"):
    dataclasses.replace(BASE, transition="gla", allow_neg_eigval=True)
