"""Cached generation: chunked prefill, then one-token decode steps in a jitted scan.

    tokens = generate(model, prompt, max_new_tokens=32)                      # greedy
    tokens = generate(model, prompt, max_new_tokens=32, rng=jax.random.key(0),
                      temperature=0.8, top_p=0.95)                           # sampling

The prompt [B, P] goes through the model once with a fresh cache
(`model.init_cache(B, P + max_new_tokens)`): linear-attention layers run their chunked
ops from a zero state and keep the final states, attention layers fill their KV cache.
Each new token then costs one decode step per layer (SSE, on either transition, touches
only the selected partitions; GLA and GDN update one state per head; attention reads the
KV cache). All sequences of a batch share one position
(no left padding) and there is no end-of-sequence stop: callers cut at their EOS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def sample_logits(logits: jax.Array, rng: jax.Array | None, *, temperature: float = 0.0,
                  top_p: float = 1.0) -> jax.Array:
  """Next tokens int32 [B] from float logits [B, V].

  temperature == 0: greedy (argmax). Otherwise sample softmax(logits / temperature)
  restricted to the nucleus: the smallest set of most likely tokens whose probability
  reaches top_p (the most likely token is always kept).
  """
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass of the more likely tokens
    kept = jnp.where(before < top_p, sorted_logits, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _check(temperature: float, top_p: float, max_new_tokens: int, rng) -> None:
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature!r} must be >= 0")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
  if temperature > 0 and rng is None:
    raise ValueError("sampling (temperature > 0) needs an rng key")


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                                             "top_p"))
def _generate(graphdef, state, prompt, rng, *, max_new_tokens, temperature, top_p):
  model = nnx.merge(graphdef, state)
  batch, length = prompt.shape
  sample = functools.partial(sample_logits, temperature=temperature, top_p=top_p)
  out = model(prompt, cache=model.init_cache(batch, length + max_new_tokens))
  rng, key = jax.random.split(rng)
  first = sample(out.logits[:, -1], key)

  def step(carry, _):
    token, cache, rng = carry
    out = model(token[:, None], cache=cache)
    rng, key = jax.random.split(rng)
    return (sample(out.logits[:, 0], key), out.cache, rng), token

  (last, _, _), tokens = jax.lax.scan(step, (first, out.cache, rng), None,
                                      length=max_new_tokens - 1)
  return jnp.concatenate([tokens.T, last[:, None]], axis=1)


def generate(model: nnx.Module, prompt: jax.Array, *, max_new_tokens: int,
             rng: jax.Array | None = None, temperature: float = 0.0,
             top_p: float = 1.0) -> jax.Array:
  """Continues prompt int [B, P]; returns the new tokens int32 [B, max_new_tokens].

  `model` is a `LanguageModel` (anything with `init_cache(batch, max_len)` and
  `__call__(tokens, cache=...) -> (logits, ..., cache)` works). Compiled once per
  (model structure, shapes, max_new_tokens, temperature, top_p).
  """
  _check(temperature, top_p, max_new_tokens, rng)
  graphdef, state = nnx.split(model)
  rng = jax.random.key(0) if rng is None else rng
  return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), rng,
                   max_new_tokens=max_new_tokens, temperature=float(temperature),
                   top_p=float(top_p))
