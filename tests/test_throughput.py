"""experiments.throughput times the trainer's own step on the presets' models."""

from __future__ import annotations

import pytest

from experiments import throughput
from sse_jax import train
from sse_jax.model import presets
from sse_jax.train import config as config_lib


@pytest.mark.parametrize("size", ["tiny", "125m"])
@pytest.mark.parametrize("variant", presets.VARIANTS)
def test_the_train_config_holds_the_preset_model(size, variant):
  """The trainer's config.model (ModelConfig.create fields) rebuilds the preset."""
  model = presets.preset(size, variant, sse={"impl": "varlen"}, gla={"impl": "chunk"})
  config = train.default_config()
  config.model = throughput.create_kwargs(model)
  config_lib.validate(config)
  assert config_lib.model_config(config) == model


def test_importing_it_defines_no_flags():
  """Its flags (--out, --workers, ...) are defined only when it runs: importing it beside
  the other experiments must not clash with theirs."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  assert "tokens" not in flags.FLAGS and "lock" not in flags.FLAGS


def _run(tmp_path, name, device, rows):
  import json  # pylint: disable=g-import-not-at-top
  meta = dict(device=device, jax="x", size="125m", tokens_per_step=32768, impl="auto",
              command=f"python -m experiments.throughput --out={name}")
  path = tmp_path / f"{name}.json"
  path.write_text(json.dumps(dict(meta=meta, rows=rows)))
  return path


def test_runs_of_one_setting_merge_in_order_and_others_are_refused(tmp_path):
  """--from_json: rows of several runs in the order given, every command kept; a run on
  another device does not merge."""
  row = lambda v, t, tps: dict(variant=v, length=t, batch=32768 // t, step_s=32768 / tps,
                               tokens_per_s=tps, peak_gib=20.0, compile_s=9.0)
  a = _run(tmp_path, "a", "gpu0", [row("sse", 2048, 2e5), row("gla", 2048, 3e5)])
  b = _run(tmp_path, "b", "gpu0", [row("sse", 8192, 1.5e5)])
  meta, rows = throughput.merge_runs([a, b])
  assert [(r["variant"], r["length"]) for r in rows] == [
      ("sse", 2048), ("gla", 2048), ("sse", 8192)]
  assert meta["command"].split(" && ") == [
      "python -m experiments.throughput --out=a", "python -m experiments.throughput --out=b"]
  out = tmp_path / "merged"
  out.mkdir()
  throughput.write_report(out, meta, rows, figure=False)
  table = (out / "throughput.md").read_text()
  assert "| sse | 8192 | 4 | 150,000 | 218.5 | 20.0 | 9 |" in table
  assert "| gla | 2048 | 16 | 300,000 | 109.2 | 20.0 | 9 |" in table
  other = _run(tmp_path, "c", "gpu1", [row("gla", 8192, 3e5)])
  with pytest.raises(ValueError, match="device='gpu1'"):
    throughput.merge_runs([a, other])
