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
