"""ModelConfig: a stack of pre-norm blocks described by a mixer pattern string.

Pattern letters (one per layer): "S" SSE, "G" GLA, "D" GDN (Gated DeltaNet), "A"
softmax attention, "W" sliding-window attention, "M" MoM (Mixture-of-Memories). E.g.
"S" * 24 pure SSE, "SSSSSA" * 3 the 18-layer SSE-H hybrid, "A" * 12 a Transformer,
"SWSWA" the SSE-SWA-SSE-SWA-Softmax hybrid.

SSE-GDN (SSE over gated delta-rule partitions) has no letter of its own: it is "S" with
sse.transition="delta" (`SSEConfig`), so everything keyed on "S" (routed layers, router
statistics, the state-size accounting) holds for it unchanged; one model has one SSE
transition.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sse_jax.layers import validation as check
from sse_jax.layers.attention import AttentionConfig
from sse_jax.layers.block import MixerConfig, check_remat
from sse_jax.layers.gdn import GDNConfig
from sse_jax.layers.gla import GLAConfig
from sse_jax.layers.mlp import MLPConfig
from sse_jax.layers.mom import MoMConfig
from sse_jax.layers.sse import SSEConfig
from sse_jax.layers.swa import SWAConfig

# letter -> (ModelConfig field, config type)
MIXERS = {"S": ("sse", SSEConfig), "G": ("gla", GLAConfig), "A": ("attention", AttentionConfig),
          "W": ("swa", SWAConfig), "M": ("mom", MoMConfig), "D": ("gdn", GDNConfig)}
# the letters of routed mixers (a router and a load-balance loss)
ROUTED = ("S", "M")


def hybrid_pattern(num_layers: int, period: int = 6, linear: str = "S") -> str:
  """`period - 1` linear layers then one attention layer, repeated: "SSSSSA"..."""
  return ((linear * (period - 1) + "A") * num_layers)[:num_layers]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Language model config.

  vocab_size: V. hidden: D. pattern: mixer letters, len(pattern) = number of layers.
  mlp: the SwiGLU sizes (every block has one).
  sse / gla / attention / swa / mom / gdn: the mixer configs used by the "S" / "G" /
    "A" / "W" / "M" / "D" layers (required for the letters present; every `hidden` must
    equal D).
  tie_embeddings: logits = h E^T with the input embedding E [V, D]; else a separate
    head [D, V].
  aux_loss_coef: multiplies the sum over routed (SSE, MoM) layers of the load-balance
    losses.
  remat: a `jax.checkpoint_policies` name for per-block rematerialisation, or None.
  norm_eps: epsilon of the block and final RMSNorms.
  """

  vocab_size: int
  hidden: int
  pattern: str
  mlp: MLPConfig
  sse: SSEConfig | None = None
  gla: GLAConfig | None = None
  attention: AttentionConfig | None = None
  swa: SWAConfig | None = None
  mom: MoMConfig | None = None
  gdn: GDNConfig | None = None
  tie_embeddings: bool = True
  aux_loss_coef: float = 0.01
  remat: str | None = None
  norm_eps: float = 1e-6

  def __post_init__(self):
    self.validate()

  @property
  def num_layers(self) -> int:
    return len(self.pattern)

  @property
  def routed_layers(self) -> tuple[int, ...]:
    """Indices of the routed (SSE, MoM) layers: the order of the model's router outputs."""
    return tuple(i for i, letter in enumerate(self.pattern) if letter in ROUTED)

  def mixer_config(self, letter: str) -> MixerConfig:
    return getattr(self, MIXERS[letter][0])

  def validate(self) -> None:
    name = "ModelConfig"
    check.positive_int(name, "vocab_size", self.vocab_size)
    check.positive_int(name, "hidden", self.hidden)
    if not isinstance(self.pattern, str) or not self.pattern:
      check.fail(name, "pattern", self.pattern, "must be a non-empty string")
    bad = sorted(set(self.pattern) - set(MIXERS))
    if bad:
      check.fail(name, "pattern", self.pattern,
                 f"has unknown mixer letters {bad}; use {', '.join(MIXERS)}")
    subs = [("mlp", self.mlp, MLPConfig)] + [
        (f, getattr(self, f), t) for f, t in MIXERS.values()]
    for field, sub, cls in subs:
      if sub is not None and type(sub) is not cls:
        check.fail(name, field, type(sub).__name__, f"must be a {cls.__name__}")
    for letter, (field, _) in MIXERS.items():
      if letter in self.pattern and getattr(self, field) is None:
        check.fail(name, field, None, f"is required by pattern letter {letter!r}")
    for field, sub, _ in subs:
      if sub is not None and sub.hidden != self.hidden:
        check.fail(name, f"{field}.hidden", sub.hidden, f"must equal hidden={self.hidden}")
    check.boolean(name, "tie_embeddings", self.tie_embeddings)
    if (not isinstance(self.aux_loss_coef, (int, float)) or isinstance(self.aux_loss_coef, bool)
        or self.aux_loss_coef < 0):
      check.fail(name, "aux_loss_coef", self.aux_loss_coef, "must be a number >= 0")
    check_remat(name, self.remat)
    check.positive_float(name, "norm_eps", self.norm_eps)

  @classmethod
  def create(cls, *, pattern: str, vocab_size: int, hidden: int, num_heads: int,
             mlp_dim: int, sse: Mapping[str, Any] | None = None,
             gla: Mapping[str, Any] | None = None,
             attention: Mapping[str, Any] | None = None,
             swa: Mapping[str, Any] | None = None, mom: Mapping[str, Any] | None = None,
             gdn: Mapping[str, Any] | None = None, **kwargs) -> "ModelConfig":
    """Builds the mixer configs with `hidden` and `num_heads` filled in.

    A mixer config is made for every letter in `pattern` (and for any override
    given); `sse` / `gla` / `attention` / `swa` / `mom` / `gdn` are field overrides,
    e.g. sse={"top_k": 2}, sse={"transition": "delta"} (SSE-GDN).
    """
    overrides = {"sse": sse, "gla": gla, "attention": attention, "swa": swa, "mom": mom,
                 "gdn": gdn}
    mixers = {}
    for letter, (field, config_type) in MIXERS.items():
      if letter in pattern or overrides[field] is not None:
        fields = dict(hidden=hidden, num_heads=num_heads, **(overrides[field] or {}))
        mixers[field] = config_type(**fields)
    return cls(vocab_size=vocab_size, hidden=hidden, pattern=pattern,
               mlp=MLPConfig(hidden, mlp_dim), **mixers, **kwargs)
