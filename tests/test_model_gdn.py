"""The GDN ("D") and SSE-GDN ("S" with transition="delta") models: the presets, one
training step end to end, cached decoding against the full forward and greedy
generation against the argmax chain of the full model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sse_jax.generate import generate
from sse_jax.layers import GDN, SSE
from sse_jax.layers.testing import random_module, router_margin
from sse_jax.model import LanguageModel, count_params
from sse_jax.model.presets import preset, tiny
from tests.op_testing import assert_close
from tests.test_generate import forward_with_router_probs
from tests.test_layers_gdn import gentle_decays
from tests.test_layers_swa import decode_logits, forward, loss_after, train_step

B, T, PROMPT = 2, 24, 9
VARIANTS = {"gdn": ("DDD", GDN), "sse_gdn": ("SSS", SSE)}


def make(variant: str, seed: int):
  model = random_module(lambda: LanguageModel(tiny(variant), rngs=nnx.Rngs(0)), seed, 0.1)
  gentle_decays(model, seed)
  return model


def test_presets():
  for size in ("tiny", "125m"):
    gdn, sse_gdn = preset(size, "gdn"), preset(size, "sse_gdn")
    assert set(gdn.pattern) == {"D"} and gdn.gdn.short_conv == 4
    assert set(sse_gdn.pattern) == {"S"} and sse_gdn.sse.transition == "delta"
  # the delta-rule variants are the size of their GLA counterparts (within 1%)
  size = lambda v: count_params(preset("125m", v)).non_embedding
  assert abs(size("gdn") / size("gla") - 1) < 0.01
  assert abs(size("sse_gdn") / size("sse") - 1) < 0.01
  assert preset("tiny", "sse_gdn", sse={"impl": "masking"}).sse.transition == "delta"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_training_step(variant):
  pattern, cls = VARIANTS[variant]
  m = make(variant, 1)
  assert m.config.pattern == pattern
  assert all(isinstance(b.mixer, cls) for b in m.blocks)
  toks = jax.random.randint(jax.random.key(6), (B, 25), 0, 256)
  optimizer = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)
  loss, out, grads = train_step(m, optimizer, toks)
  assert np.isfinite(float(loss))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  mixer = grads["blocks"][0]["mixer"]
  gates = mixer["gates"] if variant == "gdn" else mixer["decay"]
  for name, g in (("a_log", gates["a_log"]), ("b_proj", gates["b_proj"]["kernel"]),
                  ("q_proj", mixer["qkv"]["q_proj"]["kernel"])):
    assert np.abs(g[...]).max() > 0, name
  if variant == "sse_gdn":
    assert len(out.router_usage) == 3 and np.abs(mixer["router"]["kernel"][...]).max() > 0
    np.testing.assert_allclose(out.aux_loss, 0.01 * sum(out.router_aux), rtol=1e-6)
  else:
    assert out.router_usage == () and float(out.aux_loss) == 0.0
  assert loss_after(m, toks) < float(loss)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_and_greedy_generation(variant):
  m = make(variant, 2)
  toks = jax.random.randint(jax.random.key(7), (B, T), 0, 256)
  full, probs = forward_with_router_probs(m, toks)
  # Well posed only if rounding (~1e-6) cannot flip a top-k decision of any router.
  assert min([router_margin(p, m.config.sse.writers) for p in probs] + [1.0]) > 1e-4
  assert_close(decode_logits(m, toks, PROMPT), full, 1e-4, "prefill + decode vs full")
  new = generate(m, toks[:, :PROMPT], max_new_tokens=T - PROMPT)
  seq = jnp.concatenate([toks[:, :PROMPT], new], axis=1)
  want = jnp.argmax(forward(m, seq).logits[:, PROMPT - 1:-1], axis=-1)
  np.testing.assert_array_equal(new, want)


def test_the_report_places_the_new_families():
  """experiments.report: a "D" model is family "gdn" with one GLA-sized state per layer;
  SSE-GDN has SSE's active / total state; fig7 labels both families."""
  from configs import fig7  # pylint: disable=g-import-not-at-top
  from experiments import report  # pylint: disable=g-import-not-at-top
  gdn, sse_gdn = tiny("gdn"), tiny("sse_gdn")
  head = 4 * 16 * 16  # H Dk Dv
  assert report.family_of(gdn.pattern) == "gdn"
  assert report.state_floats(gdn, 32) == dict(state_floats_active=head,
                                              state_floats_total=head)
  assert report.state_floats(sse_gdn, 32) == dict(state_floats_active=2 * head,
                                                  state_floats_total=5 * head)
  runs = {r["name"]: r for r in fig7.get_config("gpu").runs}
  assert runs["GDN_dk8"]["labels"]["family"] == "gdn"
  assert runs["SSE_GDN_N4_k1"]["labels"]["family"] == "sse_gdn"
  assert runs["SSE_GDN_N4_k1"]["overrides"]["model.sse.transition"] == "delta"
  assert not any(n.startswith(("GDN", "SSE_GDN")) for n in
                 (r["name"] for r in fig7.get_config("cpu").runs))
