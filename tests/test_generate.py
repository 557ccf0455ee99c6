"""Cached generation: chunked prefill + one-token decode steps reproduce the full
forward logits at every position (hybrid, pure SSE, GLA); greedy / nucleus sampling."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax.generate import generate, sample_logits
from sse_jax.layers.testing import random_module, router_margin
from sse_jax.model import LanguageModel
from sse_jax.model.presets import preset
from tests.op_testing import assert_close

B, T, PROMPT = 2, 28, 11


def make(pattern, seed=0):
  """A tiny model (D = 64, short conv, shared partition + LoRA, GQA) with `pattern`."""
  cfg = preset("tiny", "sse_h", vocab_size=256, gla={})
  cfg = dataclasses.replace(cfg, pattern=pattern)
  return random_module(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), seed, 0.1)


@nnx.jit
def forward(model, toks, cache=None):
  return model(toks, cache=cache)


@nnx.jit
def forward_with_router_probs(model, toks):
  """The full forward's logits, and the router probabilities [B, T, N] of every SSE
  layer (one compile for both)."""
  x = jnp.take(model.embed[...], toks, axis=0)
  probs = []
  for block in model.blocks:
    if hasattr(block.mixer, "router"):
      probs.append(block.mixer.router(block.mixer_norm(x)).probs)
    x = block(x).y
  logits = jnp.einsum("btd,vd->btv", model.final_norm(x), model.embed[...])
  return logits, probs


CASES = {  # pattern: prefill split points
    "SSA": (PROMPT, 19),   # a hybrid; the second prefill chunk starts from the cache
    "SS": (PROMPT,),       # pure SSE
    "GG": (PROMPT,),       # GLA
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_reproduce_the_full_forward(case):
  splits = CASES[case]
  model = make(case)
  toks = jax.random.randint(jax.random.key(5), (B, T), 0, 256)
  full, probs = forward_with_router_probs(model, toks)
  k = model.config.sse.writers
  # Well posed only if rounding (~1e-6) cannot flip a top-k decision of any router.
  assert min([router_margin(p, k) for p in probs] + [1.0]) > 1e-4
  cache = model.init_cache(B, T)
  logits, start = [], 0
  for end in splits:                             # chunked prefill(s)
    out = forward(model, toks[:, start:end], cache)
    logits.append(out.logits)
    cache, start = out.cache, end
  for t in range(start, T):                      # one-token decode steps
    out = forward(model, toks[:, t:t + 1], cache)
    logits.append(out.logits)
    cache = out.cache
  assert_close(jnp.concatenate(logits, axis=1), full, 1e-4, case)


def test_greedy_generation_is_the_argmax_chain_of_the_full_model():
  model = make("SA", seed=1)
  prompt = jax.random.randint(jax.random.key(6), (B, PROMPT), 0, 256)
  new = generate(model, prompt, max_new_tokens=T - PROMPT)
  assert new.shape == (B, T - PROMPT) and new.dtype == jnp.int32
  seq = jnp.concatenate([prompt, new], axis=1)
  want = jnp.argmax(forward(model, seq).logits[:, PROMPT - 1:-1], axis=-1)
  np.testing.assert_array_equal(new, want)
  sampled = generate(model, prompt, max_new_tokens=5, rng=jax.random.key(0),
                     temperature=0.7, top_p=0.5)
  again = generate(model, prompt, max_new_tokens=5, rng=jax.random.key(0),
                   temperature=0.7, top_p=0.5)
  np.testing.assert_array_equal(sampled, again)
  assert sampled.shape == (B, 5) and int(sampled.min()) >= 0 and int(sampled.max()) < 256
  # Each sampled token lies in the nucleus (top_p = 0.5 of softmax(logits / 0.7)) of the
  # full model's distribution given the prompt and the tokens sampled before it.
  seq = jnp.concatenate([prompt, sampled], axis=1)
  logits = np.asarray(forward(model, seq).logits[:, PROMPT - 1:-1], np.float64) / 0.7
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  for b in range(B):
    for t in range(5):
      p, tok = probs[b, t], int(sampled[b, t])
      mass_before = p[p > p[tok]].sum()  # probability of the tokens ranked above it
      assert mass_before < 0.5 + 1e-6, (b, t, tok, mass_before)
  other = generate(model, prompt, max_new_tokens=5, rng=jax.random.key(1),
                   temperature=0.7, top_p=0.5)
  assert not np.array_equal(sampled, other), "another rng drew the same tokens"


def test_nucleus_sampling_keeps_only_the_nucleus():
  probs = np.array([0.05, 0.5, 0.15, 0.3])
  logits = jnp.log(jnp.asarray(np.tile(probs, (4000, 1)), jnp.float32))
  draws = np.asarray(sample_logits(logits, jax.random.key(1), temperature=1.0, top_p=0.7))
  # Sorted: 0.5, 0.3 | 0.15, 0.05 -- the mass before 0.15 is 0.8 >= 0.7, so it is cut.
  assert set(np.unique(draws)) == {1, 3}
  assert abs(np.mean(draws == 1) - 0.5 / 0.8) < 0.03
  np.testing.assert_array_equal(
      sample_logits(logits[:3], jax.random.key(2), temperature=1.0, top_p=1e-6), [1, 1, 1])
  np.testing.assert_array_equal(sample_logits(logits[:3], None), [1, 1, 1])


def test_generate_rejects_bad_arguments():
  model = make("G")
  prompt = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="rng"):
    generate(model, prompt, max_new_tokens=2, temperature=1.0)
  with pytest.raises(ValueError, match="top_p"):
    generate(model, prompt, max_new_tokens=2, top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompt, max_new_tokens=0)
