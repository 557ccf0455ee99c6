"""Every experiment config: all its runs build valid models, and one training step of
its first run goes end to end (tiny :cpu size) through the ablation runner's code."""

import importlib
import json
import pathlib

import ml_collections
import pytest

from configs import common
from experiments import plots
from experiments import report
from experiments import sweep
from sse_jax import train as train_lib
from sse_jax.train import config as config_lib

CONFIGS = ["fig7", "table6", "table7", "table8", "fig9", "baselines"]


def _config(name, variant="cpu"):
  return importlib.import_module(f"configs.{name}").get_config(variant)


@pytest.mark.parametrize("variant", ["cpu", None])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_run_builds_a_valid_model(name, variant, tmp_path):
  """Both variants (None: the GPU default): every run's train config passes the
  trainer's checks and builds a valid model."""
  cfg = _config(name, variant)
  assert cfg.name == f"{name}_{variant or 'gpu'}"
  jobs = sweep.expand(cfg, tmp_path)
  assert len(jobs) == len(cfg.runs) * len(cfg.lrs) * len(cfg.seeds) > 1
  assert len({j.dir for j in jobs}) == len(jobs)
  for job in jobs:
    config_lib.validate(job.config)
    config_lib.model_config(job.config)  # raises on an invalid combination
    config_lib.eval_data_config(job.config)


@pytest.mark.parametrize("name", CONFIGS)
def test_one_training_step_end_to_end(name, tmp_path):
  """The first and the last run of the sweep (fig7: N = 1 and the Transformer; fig9:
  both gap modes and widths, dense and top-k) train one step through the runner's
  code, and the report (tables and figure) is drawn from them. Only the largest pair
  count's test set is scored: the one the report reads."""
  cfg = _config(name)
  jobs = sweep.expand(cfg, tmp_path)
  picked = [jobs[0], jobs[-1]]
  assert picked[0].run != picked[1].run
  largest = max(cfg.train.eval_pairs)
  for job in picked:
    c = job.config
    c.num_steps, c.eval_every, c.log_every, c.checkpoint_every = 1, 1, 1, 1
    c.batch_size, c.eval_batches, c.warmup_steps, c.progress = 4, 1, 0, False
    c.eval_pairs = (largest,)
    summary = train_lib.train_and_evaluate(c, str(job.dir))
    assert summary["finished"] and summary["step"] == 1
    saved = json.loads((job.dir / "summary.json").read_text())
    assert saved["eval"]["loss"] == pytest.approx(summary["eval"]["loss"])
    assert 0 < saved["eval"]["loss"] < 20
  rows = report.collect(cfg, picked)
  assert [r["run"] for r in rows] == [j.run for j in picked]
  out = tmp_path / "report"
  out.mkdir()
  report.write_tables(cfg, rows, out, "cmd")
  plots.plot(cfg, rows, out / "fig.png")
  results = json.loads((out / "results.json").read_text())
  assert [r["run"] for r in results["rows"]] == [j.run for j in picked]
  assert [r["metric"] for r in results["rows"]] == [
      json.loads((j.dir / "summary.json").read_text())["eval"]["by_pairs"][str(largest)]["accuracy"]
      for j in picked]
  table = (out / "results.md").read_text()
  assert all(f"| {j.run} |" in table for j in picked), table
  assert len((out / "results.csv").read_text().strip().splitlines()) == 3
  assert (out / "fig.png").stat().st_size > 10_000


@pytest.mark.parametrize("impl, key_dim, want", [
    ("pallas_chunk", 8, "chunk"),          # Dk = 8: the kernels take 16 and up
    ("pallas_chunk", 16, "pallas_chunk"),
    ("pallas_chunk", None, "pallas_chunk"),
    ("chunk", 8, "chunk"),
    ("scan", 8, "scan"),
    ("auto", 8, "auto"),                   # resolves (and falls back) by itself
])
def test_gla_mixer_drops_pallas_for_a_key_dim_the_kernels_do_not_take(impl, key_dim, want):
  settings = ml_collections.ConfigDict(dict(key_dim=key_dim, chunk_size=16, gla_impl=impl))
  assert common.gla_mixer(settings)["impl"] == want
