"""The trainer's config file: `python -m sse_jax.train --config=configs/train_default.py`.

    --config=configs/train_default.py                  sse_jax.train.default_config(): a
                                                       small MQAR run that trains on a CPU
    --config=configs/train_default.py:RUN/config.json  the config a run saved (to resume it,
                                                       or to train it again elsewhere)

Every field of the training config (`sse_jax.train.default_config` documents them) is set
with --config.<field>=<value>, e.g. --config.num_steps=200 --config.model.pattern=SSA
--config.data.num_pairs=16. A field that is None here (model.gla, model.attention,
eval_data, ...) cannot be set by a flag: copy this file and set it in get_config.
"""

from sse_jax.train import config as config_lib


def get_config(arg: str = ""):
  """The default training config, or (arg: a path) the config.json a run saved."""
  if not arg:
    return config_lib.default_config()
  return config_lib.from_json(arg)
