"""Capacity-bound MQAR: the pair-count mixture, per-P test sets, PAD kept out of the
router statistics and the load-balance loss, and the routers' write / read agreement."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax import train as train_lib
from sse_jax.data import mqar
from sse_jax.data import make_source
from sse_jax.model import LanguageModel, ModelConfig
from sse_jax.train import config as config_lib
from sse_jax.train import loop
from sse_jax.train import metrics as metrics_lib
from sse_jax.train import steps


def test_mixture_draws_every_pair_count_and_scores_each_answer():
  c = mqar.MQARConfig(vocab_size=64, num_pairs=8, min_pairs=2, seq_len=40)
  src = mqar.MQARSource(c, split_seed=0)
  counts = collections.Counter()
  for i in range(600):
    s, p = src.sequence_and_pairs(i)
    ex = src[i]
    counts[p] += 1
    keys, values = s[0:2 * p:2], s[1:2 * p:2]
    assert len(set(keys)) == p and keys.max() <= c.num_keys < values.min()
    assert ex["weights"].sum() == p                       # every key queried once
    answers = np.flatnonzero(ex["weights"])
    assert answers[0] == mqar.answer_start(c, p) == 2 * p
    pairs = dict(zip(keys, values))
    for t in answers:                                     # the answer is the pair's value
      assert ex["targets"][t] == pairs[ex["inputs"][t]]
    assert (ex["inputs"][2 * p + 2 * p:] == mqar.PAD_ID).all()   # trailing PAD
  assert sorted(counts) == list(range(2, 9))
  assert min(counts.values()) > 600 / 7 / 2             # roughly uniform


def test_fixed_pair_count_streams_are_unchanged_by_the_mixture_field():
  """min_pairs None draws no P: the same examples as before the field existed (the
  committed fixed-P results stay reproducible)."""
  c = mqar.MQARConfig(vocab_size=64, num_pairs=4, seq_len=24)
  rng = np.random.default_rng([0, 0, 5])
  keys = 1 + rng.choice(c.num_keys, size=4, replace=False)
  s = mqar.MQARSource(c, 0).sequence(5)
  np.testing.assert_array_equal(s[0:8:2], keys)


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_pairs=0), "min_pairs=0"),
    (dict(min_pairs=9), "min_pairs=9"),
    (dict(min_pairs=2, num_queries=3), "num_queries=3"),
])
def test_mixture_refuses_impossible_configs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mqar.MQARConfig(vocab_size=64, num_pairs=8, seq_len=40, **kwargs)


def _tiny_config(**changes):
  c = train_lib.default_config()
  c.data.update(vocab_size=64, num_pairs=6, min_pairs=1, seq_len=24)
  c.model.update(hidden=16, mlp_dim=32, sse=dict(num_partitions=4, top_k=1, chunk_size=16,
                                                 short_conv=4, lora_rank=4))
  c.batch_size, c.eval_batches, c.num_steps, c.warmup_steps = 4, 1, 2, 0
  c.eval_every = c.log_every = c.checkpoint_every = 2
  c.compute_dtype, c.progress = "float32", False
  c.update(changes)
  return c


def test_test_sets_hold_1024_answers_and_are_the_same_for_every_seed(tmp_path):
  c = _tiny_config(eval_pairs=(2, 6))
  summary = train_lib.train_and_evaluate(c, str(tmp_path / "a"))
  by_pairs = summary["eval"]["by_pairs"]
  assert sorted(by_pairs) == ["2", "6"]
  # 4 rows per batch: P = 2 needs 128 batches, P = 6 43 (1032 answers)
  assert by_pairs["2"]["answers"] == 1024 and by_pairs["6"]["answers"] == 1032
  assert all(0 <= m["accuracy"] <= 1 and len(m["agreement"]) == 2
             for m in by_pairs.values())
  test = config_lib.test_config(config_lib.eval_data_config(c), 6)
  assert test["split"] == "test" and test["num_pairs"] == 6 and test["min_pairs"] is None
  assert config_lib.test_batches(c, test) == 43
  assert summary["history"][-1]["eval_by_pairs"] == summary["eval"]["by_pairs"]
  # The trainer's test batches for two seeds: the same examples (its training and
  # validation streams differ).
  batches = {}
  for seed in (0, 1):
    c.seed = seed
    train, _, tests = loop._datasets(c)
    dataset, count = tests[6]
    batches[seed] = ([b["inputs"] for _, b in zip(range(count), dataset)],
                     next(iter(train))["inputs"])
  assert len(batches[0][0]) == 43
  for a, b in zip(batches[0][0], batches[1][0]):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(batches[0][1], batches[1][1])


@pytest.mark.parametrize("changes,match", [
    (dict(eval_pairs=(0,)), "positive integers"),
    (dict(eval_pairs=(20,)), "impossible for the evaluation data"),
])
def test_bad_eval_pairs_are_refused(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(_tiny_config(**changes))


def test_eval_pairs_need_mqar_evaluation_data():
  c = _tiny_config(eval_pairs=(2,))
  c.eval_data = dict(kind="shakespeare", seq_len=24)
  with pytest.raises(ValueError, match="needs MQAR evaluation data"):
    config_lib.validate(c)


def _model(pattern="SGS"):
  config = ModelConfig.create(pattern=pattern, vocab_size=32, hidden=16, num_heads=2,
                              mlp_dim=32, sse=dict(num_partitions=4, top_k=2,
                                                   chunk_size=16, short_conv=4))
  return LanguageModel(config, rngs=nnx.Rngs(0))


def test_pad_tokens_change_neither_router_statistics_nor_balance_loss():
  """The same sequences with 9 extra PAD tokens appended: the trainer's forward pass
  (token_mask = inputs != PAD) gives the same load-balance losses and usage fractions;
  without the mask the PAD tokens would count (they do change them)."""
  model = _model()
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(0), (3, 20), 1, 32)
  padded = jnp.concatenate([tokens, jnp.zeros((3, 9), tokens.dtype)], axis=1)
  out = steps.forward(graphdef, params, {"inputs": tokens})
  out_pad = steps.forward(graphdef, params, {"inputs": padded})
  np.testing.assert_allclose(out.router_aux, out_pad.router_aux, rtol=1e-6)
  np.testing.assert_allclose(out.router_usage, out_pad.router_usage, rtol=1e-6)
  np.testing.assert_allclose(out.aux_loss, out_pad.aux_loss, rtol=1e-6)
  unmasked = model(padded)
  assert not np.allclose(unmasked.router_usage[0], out_pad.router_usage[0])


def test_route_agreement_on_a_hand_built_batch():
  """Pairs (k=1 v=5), (k=2 v=6); queries 2 -> 6, 1 -> 5. The value tokens sit at
  positions 1 and 3, the scored queries at 4 and 6."""
  inputs = jnp.array([[1, 5, 2, 6, 2, 6, 1, 5]])
  targets = jnp.array([[5, 2, 6, 2, 6, 1, 5, 0]])
  weights = jnp.array([[0, 0, 0, 0, 1, 0, 1, 0]], jnp.float32)
  pos, found = metrics_lib.value_positions(inputs, targets)
  assert pos[0, 4] == 3 and pos[0, 6] == 1 and bool(found[0, 4]) and bool(found[0, 6])
  write = jnp.array([[[0], [1], [0], [2], [0], [0], [3], [0]]])   # value 6 writes 2
  read = jnp.array([[[0], [0], [0], [0], [2], [0], [0], [0]]])    # query at 4 reads 2
  batch = dict(inputs=inputs, targets=targets, weights=weights)
  # position 4 meets (2 in {2}); position 6 reads 0 but value 5 wrote 1: no
  assert float(metrics_lib.route_agreement((write, read), batch)) == 1.0
  read = read.at[0, 6, 0].set(1)
  assert float(metrics_lib.route_agreement((write, read), batch)) == 2.0


def test_eval_sums_report_agreement_per_sse_layer():
  model = _model("SSG")
  graphdef, params = nnx.split(model, nnx.Param)
  src = make_source(dict(kind="mqar", vocab_size=32, num_pairs=4, min_pairs=2, seq_len=20))
  examples = [src[i] for i in range(4)]
  batch = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in examples[0]}
  sums = metrics_lib.eval_sums(steps.forward(graphdef, params, batch), batch, recall=True)
  assert len(sums["router_agree"]) == 2
  done = metrics_lib.finish_eval([jax.device_get(sums)], (0, 1), False)
  for layer in done["router"]:
    assert 0.0 <= layer["agreement"] <= 1.0
