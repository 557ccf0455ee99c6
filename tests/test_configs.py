"""Every experiment config: all its runs build valid models, and one training step of
its first run goes end to end (tiny :cpu size) through the ablation runner's code."""

import importlib
import json
import pathlib

import pytest

from experiments import ablation
from sse_jax import train as train_lib
from sse_jax.model import ModelConfig

CONFIGS = ["fig7", "table6", "table7", "table8", "fig9", "baselines"]


def _config(name):
  return importlib.import_module(f"configs.{name}").get_config("cpu")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_run_builds_a_valid_model(name, tmp_path):
  cfg = _config(name)
  jobs = ablation.expand(cfg, tmp_path)
  assert len(jobs) == len(cfg.runs) * len(cfg.lrs) * len(cfg.seeds) > 1
  assert len({j.dir for j in jobs}) == len(jobs)
  for job in jobs:
    model = job.config.model.to_dict()
    model.setdefault("vocab_size", job.config.data.vocab_size)
    ModelConfig.create(**model)  # raises on an invalid combination


@pytest.mark.parametrize("name", CONFIGS)
def test_one_training_step_end_to_end(name, tmp_path):
  cfg = _config(name)
  job = ablation.expand(cfg, tmp_path)[0]
  c = job.config
  c.num_steps, c.eval_every, c.log_every, c.checkpoint_every = 1, 1, 1, 1
  c.batch_size, c.eval_batches, c.warmup_steps, c.progress = 4, 1, 1, False
  summary = train_lib.train_and_evaluate(c, str(job.dir))
  assert summary["finished"] and summary["step"] == 1
  saved = json.loads((job.dir / "summary.json").read_text())
  assert saved["eval"]["loss"] == pytest.approx(summary["eval"]["loss"])
  assert 0 < saved["eval"]["loss"] < 20
  rows = ablation.collect(cfg, [job])
  assert rows[0]["run"] == job.run and rows[0]["metric"] == saved["eval"]["accuracy"]
