"""State diagnostics: each measure on hand-built states with known answers, the traced
keys / values / decays against the states the layers computed, and the command line on
a tiny stacked run."""

import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import diagnostics as cli
from sse_jax import diagnostics
from sse_jax import train
from sse_jax.model import ModelConfig
from sse_jax.model.lm import LanguageModel

# --- the measures ------------------------------------------------------------------------


def test_identical_rows_have_similarity_one_and_orthogonal_rows_zero():
  row = np.array([0.3, -1.0, 2.0, 0.5])
  same = np.tile(row, (3, 1))                                   # [Dk=3, Dv=4]
  assert diagnostics.row_similarity(same) == pytest.approx(1.0)
  np.testing.assert_allclose(diagnostics.row_cosine(2.0 * same), np.ones((3, 3)))
  orthogonal = np.eye(4)[:3] * np.array([[1.0], [5.0], [0.1]])
  assert diagnostics.row_similarity(orthogonal) == pytest.approx(0.0)
  opposite = np.stack([row, -row])
  assert diagnostics.row_similarity(opposite) == pytest.approx(-1.0)
  batch = np.stack([same[:2], opposite])                        # leading axes kept
  np.testing.assert_allclose(diagnostics.row_similarity(batch), [1.0, -1.0])


def test_zero_rows_are_left_out_of_the_similarity():
  state = np.stack([np.ones(4), np.zeros(4), np.ones(4)])
  cos = diagnostics.row_cosine(state)
  assert np.isnan(cos[1]).all() and np.isnan(cos[:, 1]).all()
  assert diagnostics.row_similarity(state) == pytest.approx(1.0)
  assert np.isnan(diagnostics.row_similarity(np.zeros((3, 4))))
  assert np.isnan(diagnostics.row_similarity(np.stack([np.ones(4), np.zeros(4)])))


def test_energy_entropy_of_rank_one_is_zero_and_of_a_flat_spectrum_one():
  rng = np.random.default_rng(0)
  u, v = rng.normal(size=(6, 1)), rng.normal(size=(1, 5))
  assert diagnostics.energy_entropy(u @ v) == pytest.approx(0.0, abs=1e-9)
  assert diagnostics.energy_entropy(3.0 * np.eye(5)) == pytest.approx(1.0)
  q, _ = np.linalg.qr(rng.normal(size=(4, 4)))
  assert diagnostics.energy_entropy(q) == pytest.approx(1.0)   # orthogonal rows
  # two equal singular values out of n = 4: H = log 2 / log 4
  assert diagnostics.energy_entropy(np.diag([1.0, 1.0, 0.0, 0.0])) == pytest.approx(0.5)
  assert np.isnan(diagnostics.energy_entropy(np.zeros((3, 3))))
  assert diagnostics.energy_entropy(np.ones((4, 1))) == 0.0     # n = 1
  assert diagnostics.energy_entropy(np.stack([u @ v, np.eye(6)[:, :5]])).shape == (2,)


def test_small_key_fraction():
  keys = np.full((2, 3, 2, 4), 1e-7)                            # [B, T, H, Dk]
  assert diagnostics.small_key_fraction(keys) == 1.0
  keys[:, :, :, 0] = -0.5                                       # |k| counts
  assert diagnostics.small_key_fraction(keys) == pytest.approx(0.75)
  keys[0, 2] = 1.0                                              # a masked-out token
  mask = np.ones((2, 3), bool)
  mask[0, 2] = False
  assert diagnostics.small_key_counts(keys, mask) == (5 * 2 * 3, 5 * 2 * 4)
  assert diagnostics.small_key_fraction(keys, mask, threshold=1e-8) == 0.0


def test_receptive_field_of_known_decays():
  t = 40
  # decay 1/2 per step: 0.5^9 >= 1e-3 > 0.5^10, so a token reaches 9 steps back
  half = np.full((1, t, 1, 1), math.log(0.5))
  rf = diagnostics.receptive_field(half, window=t)              # [B, W, H]
  np.testing.assert_array_equal(rf[0, :, 0], np.minimum(np.arange(t) + 1, 10))
  # no decay: every earlier token; only the last `window` queries are returned
  rf = diagnostics.receptive_field(np.zeros((2, t, 3, 2)), window=8)
  assert rf.shape == (2, 8, 3)
  np.testing.assert_array_equal(rf[1, :, 2], np.arange(t - 8, t) + 1)
  # the head's RF is the mean over its rows: one row of each kind -> (10 + 40) / 2 at t=39
  rows = np.concatenate([half, np.zeros_like(half)], axis=-1)
  assert diagnostics.receptive_field(rows, window=1)[0, 0, 0] == pytest.approx(25.0)
  # steps that leave the row alone (g = 0) do not count against it
  sparse = np.zeros((1, t, 1, 1))
  sparse[0, ::4] = math.log(0.5)                                # decays every 4th step
  assert diagnostics.receptive_field(sparse, window=1)[0, 0, 0] == 40  # 10 decays in 40
  assert diagnostics.receptive_field(half, threshold=0.3, window=1)[0, 0, 0] == 2
  with pytest.raises(ValueError, match="threshold"):
    diagnostics.receptive_field(half, threshold=1.0)


def test_agreement_chance():
  assert diagnostics.agreement_chance(4, 1, 1) == pytest.approx(0.25)
  assert diagnostics.agreement_chance(8, 2, 2) == pytest.approx(1 - 15 / 28)
  assert diagnostics.agreement_chance(4, 4, 1) == 1.0


def test_routed_receptive_field_follows_the_partitions_read():
  """Partition 0 decays by 1/2 at every step, partition 1 never: a query reading
  partition 1 sees every earlier token, one reading partition 0 the last 10 (all of
  them at t < 10)."""
  b, t, h, dk, dv = 1, 16, 1, 2, 2
  g = np.zeros((b, t, 2, h, dk), np.float32)
  g[:, :, 0] = math.log(0.5)
  reads = np.zeros((b, t, 1), np.int32)
  reads[:, 12:] = 1
  tr = diagnostics.LayerTrace(
      states={"routed": np.ones((b, 2, h, dk, dv))},
      keys={"routed": np.ones((b, t, 1, h, dk))}, values={}, log_decay={"routed": g},
      write_weights=np.ones((b, t, 1)), write_indices=np.zeros((b, t, 1), np.int32),
      read_indices=reads)
  stats = diagnostics.LayerStats(0, "sse")
  stats.add(tr, np.ones((b, t), bool))
  out = stats.result()
  rf = np.concatenate([np.minimum(np.arange(12) + 1, 10), np.arange(12, 16) + 1])
  field = out["types"]["routed"]["receptive_field"]
  assert field["mean"] == pytest.approx(rf.mean()) and field["std"] == 0.0
  assert field["reaches_start"] == pytest.approx(14 / 16)
  assert out["types"]["routed"]["similarity"] == pytest.approx(1.0)
  assert out["agreement"] is None and out["agreement_chance"] == pytest.approx(0.5)


# --- the traced internals against the layers' own states ---------------------------------


def _perturbed(config: ModelConfig) -> LanguageModel:
  """A model whose parameters are all random (the LoRA B starts at zero otherwise, and
  the shared and routed keys would be equal)."""
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  nnx.update(model, jax.tree.unflatten(treedef, [
      x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
  return model


def _rebuilt(tr: diagnostics.LayerTrace) -> dict[str, np.ndarray]:
  """The final states of the plain recurrence over the traced writes:
  S_t = diag(exp g_t) S_{t-1} + w k_t^T v_t, per partition."""
  out = {}
  for kind in tr.states:
    g, k, v = (np.asarray(x[kind], np.float64) for x in (tr.log_decay, tr.keys, tr.values))
    if kind == "routed":
      s = np.zeros(g.shape[:1] + g.shape[2:] + v.shape[-1:])       # [B, N, H, Dk, Dv]
      idx, w = np.asarray(tr.write_indices), np.asarray(tr.write_weights, np.float64)
      rows = np.arange(g.shape[0])
      for u in range(g.shape[1]):
        s = np.exp(g[:, u])[..., None] * s
        for j in range(idx.shape[-1]):
          s[rows, idx[:, u, j]] += w[:, u, j, None, None, None] * np.einsum(
              "bhk,bhv->bhkv", k[:, u, j], v[:, u, j])
    else:
      s = np.zeros(g.shape[:1] + g.shape[2:] + v.shape[-1:])       # [B, H, Dk, Dv]
      for u in range(g.shape[1]):
        s = np.exp(g[:, u])[..., None] * s + np.einsum("bhk,bhv->bhkv", k[:, u], v[:, u])
    out[kind] = s
  return out


@pytest.mark.parametrize("overrides", [
    # row-sparse GLA; SSE with the LoRA on the routed side, its own shared decay, a
    # short conv, a read set larger than the write set and the write-only gate
    dict(pattern="GSA", gla=dict(key_activation="topk-softmax", key_dim=8), attention={},
         sse=dict(num_partitions=4, top_k=2, num_readers=3, lora_rank=4, short_conv=4,
                  lora_target="routed", gate_placement="write")),
    # per-partition projections, paper LoRA target
    dict(pattern="S", sse=dict(num_partitions=3, top_k=1, share_partition_params=False,
                               impl="masking")),
], ids=["gla_sse", "per_partition"])
def test_traced_writes_rebuild_the_layers_final_states(overrides):
  sse = dict(chunk_size=16, **overrides.pop("sse", {}))
  config = ModelConfig.create(vocab_size=32, hidden=32, num_heads=2, mlp_dim=32, sse=sse,
                              **overrides)
  model = _perturbed(config)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 32)
  layers = diagnostics.trace(model, tokens)
  assert [tr is None for tr in layers] == [c == "A" for c in config.pattern]
  for tr in filter(None, layers):
    for kind, want in _rebuilt(tr).items():
      got = np.asarray(tr.states[kind])
      assert got.shape == want.shape, kind
      np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), err_msg=kind)


# --- the command line on a trained run ---------------------------------------------------


def _tiny_config(seed: int):
  c = train.default_config()
  c.model.pattern, c.model.hidden, c.model.mlp_dim = "SG", 32, 64
  c.model.sse = {"num_partitions": 4, "top_k": 1, "chunk_size": 16, "lora_rank": 4}
  c.model.gla = {"chunk_size": 16, "key_activation": "softmax"}
  c.data.seq_len, c.data.num_pairs, c.data.vocab_size = 32, 4, 64
  c.batch_size, c.num_steps, c.warmup_steps, c.eval_batches = 8, 3, 1, 1
  c.compute_dtype, c.progress, c.lr, c.seed = "float32", False, 1e-2, seed
  c.log_every = c.eval_every = c.checkpoint_every = 3
  return c


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> pathlib.Path:
  """A sweep-style run directory: two seeds trained stacked for three steps."""
  run = tmp_path_factory.mktemp("sweep") / "N4_k1"
  train.train_stacked([_tiny_config(0), _tiny_config(1)],
                      [str(run / "lr0.01_s0"), str(run / "lr0.01_s1")])
  return run


def _finite_numbers(tree, path=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _finite_numbers(v, f"{path}.{k}")
  elif isinstance(tree, list):
    for i, v in enumerate(tree):
      yield from _finite_numbers(v, f"{path}[{i}]")
  elif isinstance(tree, float):
    assert math.isfinite(tree), path
    yield path, tree


def test_command_line_on_a_stacked_run(tiny_run, tmp_path, capsys):
  out = tmp_path / "out"
  assert cli.main([f"--run={tiny_run}", f"--compare={tiny_run / 'lr0.01_s1'}",
                   "--pairs=4", "--batches=2", f"--out={out}"]) == 0
  printed = capsys.readouterr().out
  assert "[diagnostics] N4_k1 lr0.01_s0: step 3, batch 2/2" in printed
  for figure in cli.FIGURES:
    assert (out / f"{figure}.png").stat().st_size > 5_000, figure
  result = json.loads((out / "diagnostics.json").read_text())
  assert [r["label"] for r in result["runs"]] == ["N4_k1", "N4_k1 (2)"]
  run, single = result["runs"]
  assert [s["seed"] for s in run["seeds"]] == [0, 1]
  assert run["data"]["num_pairs"] == 4 and run["data"]["split"] == "test"
  assert [(e["layer"], e["mixer"], sorted(e["types"])) for e in run["layers"]] == [
      (0, "sse", ["routed", "shared"]), (1, "gla", ["gla"])]
  for path, value in _finite_numbers(result["runs"]):
    name = path.rsplit(".", 1)[-1]
    if name in ("similarity", "similarity_matrix") or "similarity_matrix" in path:
      assert -1.0 <= value <= 1.0, path
    elif name in ("entropy", "empty_states", "small_keys", "agreement",
                  "agreement_chance", "reaches_start"):
      assert 0.0 <= value <= 1.0, path
  for entry in run["layers"]:
    for numbers in entry["types"].values():
      rf = numbers["receptive_field"]
      assert 1.0 <= rf["mean"] <= 32 and rf["std"] >= 0 and len(rf["per_head"]) == 2
      assert numbers["entropy"] is not None and numbers["similarity"] is not None
  sse = run["layers"][0]
  assert sse["answers"] == 2 * 8 * 4 and sse["agreement_chance"] == pytest.approx(0.25)
  # the run's numbers are the seeds' mean; the compared seed directory is its seed 1
  seeds = [s["layers"][1]["types"]["gla"]["entropy"] for s in run["seeds"]]
  assert run["layers"][1]["types"]["gla"]["entropy"] == pytest.approx(np.mean(seeds))
  assert single["layers"][1]["types"]["gla"]["entropy"] == pytest.approx(seeds[1])


def test_missing_run_or_checkpoint_is_one_line(tiny_run, tmp_path, capsys):
  assert cli.main([f"--run={tmp_path / 'nowhere'}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "does not exist" in err
  bare = tmp_path / "bare"
  bare.mkdir()
  assert cli.main([f"--run={bare}"]) == 2
  assert "no config.json" in capsys.readouterr().err
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  shutil.copy(tiny_run / "lr0.01_s0" / "config.json", fresh / "config.json")
  assert cli.main([f"--run={fresh}", f"--out={tmp_path / 'o'}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no checkpoints" in err
  assert cli.main([f"--run={tiny_run}", "--lr=0.5"]) == 2
  assert "no seeds at --lr=0.5" in capsys.readouterr().err
