"""Model presets: the paper's 600M and 2B sizes, a ~125M family for throughput
benchmarks, and tiny models for tests.

Variants (the `pattern`): "sse" (all SSE), "sse_h" (5 SSE + 1 attention, repeated),
"gla" (all GLA), "gla_h" (5 GLA + 1 attention), "transformer" (all attention).

How the sizes were chosen (paper Table 9: 600M = 24 layers, hidden 1024, 8 heads,
300M non-embedding; 2B = 18 layers, hidden 2304, 18 heads, 1.3B non-embedding, 3
attention layers in the hybrid). The paper does not give head or MLP widths, so:
  * every linear-attention mixer uses head dims Dk = Dv = D / H = 128 (the head dim
    of the paper's kernel benchmarks) and the official output gate, so W_q, W_k, W_v,
    W_gate, W_o are D x D each, plus the rank-16 decay gate; SSE adds the router
    (D x N) and the rank-64 shared-partition LoRA on q and k; attention layers have
    W_q, W_k, W_v, W_o only (RoPE, no biases);
  * the SwiGLU width I is then the multiple of 256 that brings the SSE models closest
    to the paper's count: I = 2304 (2.25 D) at 600M, I = 6656 (2.89 D) at 2B;
  * the Transformer variants get a wider MLP (+512 / +768) to stay at equal size.
Non-embedding counts (vocab-independent; `count_params`, eval_shape only, N = 4):
  600M: sse 303.0M, sse_h 297.6M, gla 296.6M, transformer 308.3M    (paper 300M)
  2B:   sse 1318.1M, sse_h 1300.2M, gla 1307.3M, transformer 1306.0M (paper 1.3B)
  125M: sse 94.7M, sse_h 93.1M, gla 92.3M, gla_h 91.1M, transformer 92.0M
With share_partition_params=False (Table 8: N + 1 = 5 sets of W_q, W_k, W_v) the 600M
SSE has 598.7M non-embedding parameters (paper: 580M).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sse_jax.model.config import ModelConfig, hybrid_pattern

VARIANTS = ("sse", "sse_h", "gla", "gla_h", "transformer")


class Size(NamedTuple):
  layers: int
  hidden: int
  heads: int
  mlp: int              # SwiGLU width of the linear-attention variants
  transformer_mlp: int  # SwiGLU width of the all-attention variant (equal size)


SIZES = {
    "tiny": Size(3, 64, 4, 128, 160),
    "125m": Size(12, 768, 6, 2048, 2304),
    "600m": Size(24, 1024, 8, 2304, 2816),
    "2b": Size(18, 2304, 18, 6656, 7424),
}


def pattern_for(variant: str, layers: int) -> str:
  period = min(6, layers)  # tiny (3 layers): "SSA"
  patterns = {"sse": "S" * layers, "sse_h": hybrid_pattern(layers, period),
              "gla": "G" * layers, "gla_h": hybrid_pattern(layers, period, linear="G"),
              "transformer": "A" * layers}
  if variant not in patterns:
    raise ValueError(f"variant={variant!r} is not one of {', '.join(VARIANTS)}")
  return patterns[variant]


def preset(size: str, variant: str = "sse", *, vocab_size: int = 32000,
           sse: dict[str, Any] | None = None, gla: dict[str, Any] | None = None,
           attention: dict[str, Any] | None = None, **kwargs) -> ModelConfig:
  """ModelConfig for `size` in SIZES and `variant` in VARIANTS.

  `sse` / `gla` / `attention` override mixer fields (e.g. sse={"num_partitions": 8,
  "top_k": 2}); other keywords go to ModelConfig (tie_embeddings, remat, ...).
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
  s = SIZES[size]
  pattern = pattern_for(variant, s.layers)
  if size == "tiny":  # short chunks and the learning aids tests want to exercise
    sse = {"chunk_size": 16, "short_conv": 4, "lora_rank": 8, **(sse or {})}
    gla = {"chunk_size": 16, "short_conv": 4, **(gla or {})}
    attention = {"num_kv_heads": 2, **(attention or {})}
  return ModelConfig.create(
      pattern=pattern, vocab_size=vocab_size, hidden=s.hidden, num_heads=s.heads,
      mlp_dim=s.transformer_mlp if variant == "transformer" else s.mlp,
      sse=sse, gla=gla, attention=attention, **kwargs)


def tiny(variant: str = "sse_h", *, vocab_size: int = 256, **kwargs) -> ModelConfig:
  """3 layers, D = 64, 4 heads of 16, short conv 4, GQA (2 KV heads), chunk 16."""
  return preset("tiny", variant, vocab_size=vocab_size, **kwargs)


def paper_600m(variant: str = "sse", **kwargs) -> ModelConfig:
  return preset("600m", variant, **kwargs)


def paper_2b(variant: str = "sse_h", **kwargs) -> ModelConfig:
  return preset("2b", variant, **kwargs)


def small_125m(variant: str = "sse", **kwargs) -> ModelConfig:
  """12 layers, D = 768, 6 heads of 128: ~95M non-embedding + 25M embedding."""
  return preset("125m", variant, **kwargs)
