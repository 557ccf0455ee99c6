"""The trainer treats every routed layer (SSE "S" and MoM "M") alike: its evaluation
reports router statistics and MQAR route agreement for each, and the load-balance loss
of each is in the training loss."""

from __future__ import annotations

import numpy as np

from sse_jax import train as train_lib
from sse_jax.train import config as config_lib


def _config(pattern: str):
  c = train_lib.default_config()
  c.model.pattern, c.model.hidden, c.model.num_heads, c.model.mlp_dim = pattern, 32, 2, 64
  c.model.sse = dict(num_partitions=4, top_k=1, chunk_size=16, short_conv=0, lora_rank=4)
  c.model.mom = dict(num_memories=3, top_k=2, chunk_size=16)
  c.model.gla = dict(chunk_size=16)
  c.data.vocab_size, c.data.num_pairs, c.data.seq_len = 32, 4, 16
  c.eval_pairs = (2,)
  c.batch_size, c.num_steps, c.warmup_steps, c.lr = 4, 2, 0, 1e-3
  c.log_every = c.eval_every = c.checkpoint_every = 2
  c.eval_batches, c.compute_dtype, c.progress = 1, "float32", False
  return c


def test_mom_layers_get_router_statistics_like_sse_layers(tmp_path):
  """"GSM": the SSE layer (1) and the MoM layer (2) each have a router entry, in layer
  order, with one usage fraction per partition / memory summing to its top-k, and an
  agreement on the test set; the GLA layer (0) has none."""
  c = _config("GSM")
  summary = train_lib.train_and_evaluate(c, str(tmp_path / "run"))
  assert config_lib.model_config(c).routed_layers == (1, 2)
  router = summary["eval"]["router"]
  assert [r["layer"] for r in router] == [1, 2]
  assert [len(r["usage"]) for r in router] == [4, 3]
  np.testing.assert_allclose([sum(r["usage"]) for r in router], [1.0, 2.0], rtol=1e-5)
  for r in router:
    assert 0.0 <= r["entropy"] <= 1.0 and r["agreement"] is not None
  agreement = summary["eval"]["by_pairs"]["2"]["agreement"]
  assert len(agreement) == 2 and all(0.0 <= a <= 1.0 for a in agreement)


def _last_train_record(pattern: str, workdir) -> dict:
  """The last train record of a run of `pattern`. Without the P = 2 test set (128
  batches of 4 at the final evaluation): only the training loss is read."""
  c = _config(pattern)
  c.eval_pairs = ()
  return train_lib.train_and_evaluate(c, str(workdir))["train"]


def test_mom_load_balance_loss_is_in_the_training_loss(tmp_path):
  """A pure MoM model trains with aux_loss = coef * N/k sum_i f_i p_i > 0 (about coef
  when balanced), loss = ce + aux_loss; a GLA model has aux_loss 0."""
  mom = _last_train_record("MM", tmp_path / "mom")
  gla = _last_train_record("GG", tmp_path / "gla")
  assert 0.005 < mom["aux_loss"] < 0.1
  np.testing.assert_allclose(mom["loss"], mom["ce"] + mom["aux_loss"], rtol=1e-6)
  assert gla["aux_loss"] == 0.0
