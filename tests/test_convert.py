"""Transformer -> SSE-H / GLA-H conversion (experiments.weight_map, experiments.convert,
configs/table4.py): the weight mapping against the attention layer's own projections,
the config's stages end to end at tiny size, and one-line errors for bad sources."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import table4
from experiments import convert
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import weight_map
from sse_jax import train as train_lib
from sse_jax.model import LanguageModel, ModelConfig
from sse_jax.train import state as state_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _model(pattern, *, kv_heads=None, conv=4, sse=None, **kw):
  return ModelConfig.create(
      pattern=pattern, vocab_size=32, hidden=32, num_heads=2, mlp_dim=64,
      attention=dict(num_kv_heads=kv_heads, short_conv=conv),
      sse=dict(short_conv=conv, lora_rank=4, chunk_size=16, **(sse or {})),
      gla=dict(short_conv=conv, chunk_size=16), **kw)


def _params(config, seed):
  return state_lib.split_model(LanguageModel(config, rngs=nnx.Rngs(seed)))[1]


def _module(config, params):
  model = LanguageModel(config, rngs=nnx.Rngs(99))
  nnx.update(model, nnx.State(jax.tree.map(jnp.asarray, params)))
  return model


@pytest.mark.parametrize("letter, kv_heads, per_partition", [
    ("S", None, False), ("G", None, False), ("S", 1, False), ("G", 1, False),
    ("S", None, True)])
def test_converted_projections_equal_the_attention_layers(letter, kv_heads, per_partition):
  """On the same x [B, T, D]: the converted layer's q / k / v projections give the
  attention layer's (kv heads repeated over their query heads under GQA, every
  partition's copy with per-partition projections) and its output projection maps any
  o [B, T, H, Dh] as W_o does; the short convs equal too. The unchanged layer, the
  embedding, block norms and MLPs are the source's; decay gate, router, output norm and
  gate are the target's own init."""
  source = _model("AA", kv_heads=kv_heads)
  target = _model("A" + letter, kv_heads=kv_heads,
                  sse=dict(share_partition_params=not per_partition))
  src_params, fresh = _params(source, 0), _params(target, 1)
  params, carried = weight_map.convert_params(src_params, source, fresh, target)
  src, tgt = _module(source, src_params), _module(target, params)
  x = jax.random.normal(jax.random.key(0), (2, 5, 32))
  a, m = src.blocks[1].mixer, tgt.blocks[1].mixer
  groups = 2 // (kv_heads or 2)
  rep = lambda y: jnp.repeat(y, groups, axis=2)
  part = (lambda y: y[:, :, 1]) if per_partition else (lambda y: y)  # partition 1 of 5
  # the same weights: W_q exactly; W_k / W_v repeated over the heads sum in another
  # order under GQA (1 ulp), so those compare at float32 rounding
  close = dict(rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(part(m.qkv.q_proj(x)), a.q(x))
  np.testing.assert_allclose(part(m.qkv.k_proj(x)), rep(a.k(x)), **close)
  np.testing.assert_allclose(part(m.qkv.v_proj(x)), rep(a.v(x)), **close)
  k_kernel = params["blocks"][1]["mixer"]["qkv"]["k_proj"]["kernel"]
  want = np.repeat(src_params["blocks"][1]["mixer"]["k"]["kernel"], groups, axis=1)
  np.testing.assert_array_equal(k_kernel[:, 1] if per_partition else k_kernel, want)
  o = jax.random.normal(jax.random.key(1), (2, 5, 2, 16))
  np.testing.assert_array_equal(m.out.proj(o), a.o(o))
  # conv kernels [w, (P,) H, D*]: every partition's copy is the attention's
  copies = lambda k: np.broadcast_to(k[:, None], (4, 5) + k.shape[1:]) if per_partition else k
  np.testing.assert_array_equal(m.qkv.q_conv.kernel[...], copies(a.q_conv.kernel[...]))
  np.testing.assert_array_equal(m.qkv.k_conv.kernel[...],
                                copies(np.repeat(a.k_conv.kernel[...], groups, axis=-2)))
  y_src = src.blocks[0](x, None).y
  np.testing.assert_array_equal(tgt.blocks[0](x, None).y, y_src)  # layer 0 unchanged
  np.testing.assert_array_equal(tgt.embed[...], src.embed[...])
  for name in ("mixer_norm", "mlp_norm"):
    np.testing.assert_array_equal(getattr(tgt.blocks[1], name).scale[...],
                                  getattr(src.blocks[1], name).scale[...])
  np.testing.assert_array_equal(tgt.blocks[1].mlp.up.kernel[...],
                                src.blocks[1].mlp.up.kernel[...])
  fresh_mixer = fresh["blocks"][1]["mixer"]
  np.testing.assert_array_equal(params["blocks"][1]["mixer"]["decay"]["bias"],
                                fresh_mixer["decay"]["bias"])
  np.testing.assert_array_equal(params["blocks"][1]["mixer"]["out"]["gate"]["kernel"],
                                fresh_mixer["out"]["gate"]["kernel"])
  if letter == "S":
    np.testing.assert_array_equal(params["blocks"][1]["mixer"]["router"]["kernel"],
                                  fresh_mixer["router"]["kernel"])
  assert "blocks/1/mixer/qkv/q_proj/kernel" in carried
  assert not any("decay" in p or "router" in p for p in carried)
  # the converted layer really differs from a fresh one (the mapping did something)
  assert not np.allclose(fresh_mixer["qkv"]["q_proj"]["kernel"],
                         params["blocks"][1]["mixer"]["qkv"]["q_proj"]["kernel"])


def test_short_conv_of_another_width_is_not_carried():
  source = _model("AA")
  target = ModelConfig.create(pattern="AS", vocab_size=32, hidden=32, num_heads=2,
                              mlp_dim=64, attention=dict(short_conv=4),
                              sse=dict(short_conv=3, lora_rank=4, chunk_size=16))
  fresh = _params(target, 1)
  params, carried = weight_map.convert_params(_params(source, 0), source, fresh, target)
  assert not any("conv" in p for p in carried if p.startswith("blocks/1/mixer"))
  np.testing.assert_array_equal(params["blocks"][1]["mixer"]["qkv"]["q_conv"]["kernel"],
                                fresh["blocks"][1]["mixer"]["qkv"]["q_conv"]["kernel"])


@pytest.mark.parametrize("target, message", [
    (dict(pattern="AAS"), "has 3 layers, the source 'AA' 2"),
    (dict(pattern="AA"), "replaces no attention layer"),
    (dict(pattern="AW"), "'A' -> 'W' cannot be converted"),
    (dict(pattern="AS", sse=dict(key_dim=8)), "key_dim=8 must equal the attention head dim 16"),
    (dict(pattern="AS", mlp_dim=32), "target mlp="),
])
def test_targets_that_are_not_conversions_are_one_line_errors(target, message):
  source = _model("AA")
  fields = dict(vocab_size=32, hidden=32, num_heads=2, mlp_dim=64,
                attention=dict(short_conv=4), swa=dict(window=4, short_conv=4))
  fields.update(target)
  config = ModelConfig.create(**fields)
  with pytest.raises(ValueError, match=message) as e:
    weight_map.convert_params(_params(source, 0), source, _params(config, 1), config)
  assert "\n" not in str(e.value)


# --- the config through the runner's stages --------------------------------------------


def _tiny(cfg):
  """Four steps at batch 4, scored on the largest pair count's test set alone (the one
  the verdict reads)."""
  t = cfg.train
  t.batch_size, t.eval_batches, t.num_steps, t.warmup_steps = 4, 1, 4, 0
  t.eval_every, t.log_every, t.checkpoint_every, t.progress = 2, 2, 4, False
  t.eval_pairs = (max(t.eval_pairs),)
  cfg.seeds = (0,)
  return cfg


def test_table4_configs_build_and_derive_the_continued_budget(tmp_path):
  for variant, seeds in (("cpu", 1), (None, 3)):
    cfg = table4.get_config(variant)
    jobs = convert.with_budget(cfg, sweep.expand(cfg, tmp_path))
    assert len(cfg.seeds) == seeds and len(jobs) == 5 * seeds
    steps = {j.run: j.config.num_steps for j in jobs}
    n = cfg.train.num_steps
    assert steps == {"Transformer": n, **{r: round(n * cfg.continue_fraction)
                                          for r in steps if r != "Transformer"}}
    patterns = {j.run: j.config.model["pattern"] for j in jobs}
    assert patterns["SSE-H_converted"] == patterns["SSE-H_scratch"] == "AS"
    assert patterns["GLA-H_converted"] == "AG" and patterns["Transformer"] == "AA"
    for job in jobs:
      train_lib.config.validate(job.config)
      train_lib.config.model_config(job.config)


def test_one_step_end_to_end(tmp_path):
  """Source trains, SSE-H converted is seeded from it and continues one step (its
  first train record starts from the converted weights: lower loss than from scratch is
  not asserted, the weights are), GLA-H from scratch trains one step; the report, the
  figure and the verdict come out."""
  cfg = _tiny(table4.get_config("cpu"))
  jobs = convert.with_budget(cfg, sweep.expand(cfg, tmp_path))
  by_run = {j.run: j for j in jobs}
  source, conv, scratch = (by_run[n] for n in ("Transformer", "SSE-H_converted",
                                                "GLA-H_scratch"))
  assert conv.config.num_steps == 1 and conv.config.warmup_steps == 0
  train_lib.train_and_evaluate(source.config, str(source.dir))
  carried = convert.seed_converted(cfg, jobs, conv)
  assert "blocks/1/mixer/qkv/k_proj/kernel" in carried
  seeded, step = train_lib.load_state(conv.config, str(conv.dir))
  trained, _ = train_lib.load_state(source.config, str(source.dir))
  assert step == 0
  np.testing.assert_array_equal(seeded.params["blocks"][1]["mixer"]["qkv"]["q_proj"]["kernel"],
                                trained.params["blocks"][1]["mixer"]["q"]["kernel"])
  np.testing.assert_array_equal(seeded.params["blocks"][0]["mixer"]["v"]["kernel"],
                                trained.params["blocks"][0]["mixer"]["v"]["kernel"])
  for job in (conv, scratch):
    summary = train_lib.train_and_evaluate(job.config, str(job.dir))
    assert summary["finished"] and summary["step"] == 1
  assert json.loads((conv.dir / "summary.json").read_text())["resumed_from"] == 0
  picked = [source, conv, scratch]
  rows = report.collect(cfg, picked)
  assert [r["labels"]["init"] for r in rows] == ["trained", "converted", "scratch"]
  out = tmp_path / "report"
  out.mkdir()
  report.write_tables(cfg, rows, out, "cmd")
  plots.plot(cfg, rows, out / "fig.png")
  assert (out / "fig.png").stat().st_size > 10_000
  line = convert.verdict_line(cfg, rows)
  assert line.startswith("Verdict (P=8") and "\n" not in line
  assert "SSE-H: converted or scratch run missing" in line  # no SSE-H_scratch trained
  assert "GLA-H: converted or scratch run missing" in line


def test_bad_sources_are_one_line_errors(tmp_path):
  """An unfinished source, a damaged checkpoint and a source that does not convert each
  stop the conversion with a ConversionError of one line naming the source."""
  cfg = _tiny(table4.get_config("cpu"))
  jobs = convert.with_budget(cfg, sweep.expand(cfg, tmp_path))
  by_run = {j.run: j for j in jobs}
  source, conv = by_run["Transformer"], by_run["SSE-H_converted"]
  with pytest.raises(convert.ConversionError, match="has not finished"):
    convert.seed_converted(cfg, jobs, conv)
  train_lib.train_and_evaluate(source.config, str(source.dir))
  state_dir = source.dir / "checkpoints" / "4" / "state"
  victim = max((p for p in state_dir.rglob("*") if p.is_file()), key=os.path.getsize)
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0xFF
  victim.write_bytes(bytes(data))
  with pytest.raises(convert.ConversionError, match="unusable checkpoint") as e:
    convert.seed_converted(cfg, jobs, conv)
  assert str(source.dir) in str(e.value) and "\n" not in str(e.value)
  data[len(data) // 2] ^= 0xFF
  victim.write_bytes(bytes(data))
  conv.config.model["sse"]["key_dim"] = 8  # the head dim is 32: W_q cannot carry over
  with pytest.raises(convert.ConversionError, match="does not seed the converted run: layer 1 .S.: "
                     "key_dim=8 must equal the attention head dim 32") as e:
    convert.seed_converted(cfg, jobs, conv)
  assert "\n" not in str(e.value)
  assert not (conv.dir / "checkpoints" / "0").exists()


def test_cli_refuses_workers_and_non_conversion_configs(tmp_path):
  """Usage mistakes: one line on stderr, exit status 2, before anything trains."""
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for args, message in (
      (["--config=configs/table4.py:cpu", "--workers=2"], "--workers and --job"),
      (["--config=configs/table8.py:cpu"], "not a conversion config"),
      (["--config=configs/table4.py:cpu", "--only=nope"], "unknown run names ['nope']")):
    done = subprocess.run([sys.executable, "-m", "experiments.convert",
                           f"--workdir={tmp_path}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
