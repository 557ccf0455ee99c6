"""AdamW with linear warm-up + cosine decay and global-norm clipping (optax).

    lr(s) = lr * s / warmup                                            s < warmup
    lr(s) = lr * (r + (1 - r) (1 + cos(pi (s - warmup) / (S - warmup))) / 2)   after
with r = min_lr_ratio and S = num_steps; s counts the updates already applied (the
first update uses lr(0), which is 0 with a warm-up).

Weight decay is decoupled (AdamW, scaled by lr(s)) and masked: kernels and embeddings
decay; RMSNorm scales and biases (leaves named "scale" / "bias", e.g. the decay gate's
bias) do not, since pulling them to 0 would fight their role (unit gain, gate offset).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

NO_DECAY = ("scale", "bias")


def schedule(config) -> optax.Schedule:
  warmup = min(config.warmup_steps, config.num_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.lr, warmup_steps=warmup,
      decay_steps=max(config.num_steps, warmup + 1),
      end_value=config.lr * config.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """True for the leaves that get weight decay (everything not named scale / bias)."""
  def decays(path, _):
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", None))
    return name not in NO_DECAY
  return jax.tree_util.tree_map_with_path(decays, params)


def optimizer(config) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) -> adamw(schedule, b1, b2, eps, weight_decay, mask)."""
  adamw = optax.adamw(schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw
