"""Model presets: the paper's 600M and 2B sizes, a ~125M family for throughput
benchmarks, and tiny models for tests.

Variants (the `pattern`): "sse" (all SSE), "sse_h" (5 SSE + 1 attention, repeated),
"gla" (all GLA), "gla_h" (5 GLA + 1 attention), "transformer" (all attention), "gdn"
(all Gated DeltaNet, "D"), "sse_gdn" (all SSE on the delta rule: "S" with
transition="delta", otherwise the "sse" layer): the equal-size family `VARIANTS`.
Two more (`EXTRA_VARIANTS`, not size-matched): "sse_swa", SSE-SWA-SSE-SWA-Softmax
repeated (the paper's 12B conversion pattern; "SWA" at 3 layers), sliding windows of
512 (8 at the tiny size); "mom", all MoM
(Mixture-of-Memories, N = 4 memories, top-1, a shared memory; GLA transition) with a
narrower MLP so that its *active* count matches the linear variants.

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
  gdn (W_a, W_b [D, H] instead of the rank-16 gate; the official short conv of width
  4 at every size) 92.3M / 296.4M / 1307.9M and sse_gdn 94.5M / 302.5M / 1318.2M at
  125M / 600M / 2B.
With share_partition_params=False (Table 8: N + 1 = 5 sets of W_q, W_k, W_v) the 600M
SSE has 598.7M non-embedding parameters (paper: 580M).
sse_swa (SWA layers are attention-sized, at the SSE MLP width): 125M 89.0M, 600M 284.1M,
2B 1258.3M.
MoM (n4k1, `mom_mlp`): a layer has N + 1 = 5 sets of W_k, W_v and decay gates, of which
a token uses 2 (its memory and the shared one): one more active W_k, W_v per layer than
GLA, paid for with a narrower MLP, and three inactive sets. Non-embedding, total /
active: 125M 136.1M / 92.7M, 600M 463.5M / 310.1M, 2B 1886.3M / 1308.9M. The paper's
MoM-n4k1 at the 600M size is 800M total / 600M active: ~200M of inactive memories on a
model of the dense size; here 153M (D x D key and value projections per memory).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sse_jax.model.config import ModelConfig, hybrid_pattern

VARIANTS = ("sse", "sse_h", "gla", "gla_h", "transformer", "gdn", "sse_gdn")
EXTRA_VARIANTS = ("sse_swa", "mom")


class Size(NamedTuple):
  layers: int
  hidden: int
  heads: int
  mlp: int              # SwiGLU width of the linear-attention variants
  transformer_mlp: int  # SwiGLU width of the all-attention variant (equal size)
  mom_mlp: int          # SwiGLU width of the MoM variant (equal active size)


SIZES = {
    "tiny": Size(3, 64, 4, 128, 160, 128),
    "125m": Size(12, 768, 6, 2048, 2304, 1536),
    "600m": Size(24, 1024, 8, 2304, 2816, 1792),
    "2b": Size(18, 2304, 18, 6656, 7424, 5120),
}

SWA_WINDOW = {"tiny": 8}  # other sizes: SWAConfig's default (512)


def swa_hybrid_pattern(layers: int) -> str:
  """SSE-SWA-SSE-SWA-Softmax ("SWSWA") repeated; "SWA" below 5 layers."""
  period = "SWSWA" if layers >= 5 else "SWA"
  return (period * layers)[:layers]


def pattern_for(variant: str, layers: int) -> str:
  period = min(6, layers)  # tiny (3 layers): "SSA"
  patterns = {"sse": "S" * layers, "sse_h": hybrid_pattern(layers, period),
              "gla": "G" * layers, "gla_h": hybrid_pattern(layers, period, linear="G"),
              "transformer": "A" * layers, "sse_swa": swa_hybrid_pattern(layers),
              "mom": "M" * layers, "gdn": "D" * layers, "sse_gdn": "S" * layers}
  if variant not in patterns:
    raise ValueError(f"variant={variant!r} is not one of "
                     f"{', '.join(VARIANTS + EXTRA_VARIANTS)}")
  return patterns[variant]


def preset(size: str, variant: str = "sse", *, vocab_size: int = 32000,
           sse: dict[str, Any] | None = None, gla: dict[str, Any] | None = None,
           attention: dict[str, Any] | None = None, swa: dict[str, Any] | None = None,
           mom: dict[str, Any] | None = None, gdn: dict[str, Any] | None = None,
           **kwargs) -> ModelConfig:
  """ModelConfig for `size` in SIZES and `variant` in VARIANTS or EXTRA_VARIANTS.

  `sse` / `gla` / `attention` / `swa` / `mom` / `gdn` override mixer fields (e.g.
  sse={"num_partitions": 8, "top_k": 2}); other keywords go to ModelConfig
  (tie_embeddings, remat, ...).
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
  s = SIZES[size]
  pattern = pattern_for(variant, s.layers)
  if variant == "sse_gdn":
    sse = {"transition": "delta", **(sse or {})}
  if "W" in pattern and size in SWA_WINDOW:
    swa = {"window": SWA_WINDOW[size], **(swa or {})}
  if size == "tiny":  # short chunks and the learning aids tests want to exercise
    sse = {"chunk_size": 16, "short_conv": 4, "lora_rank": 8, **(sse or {})}
    gla = {"chunk_size": 16, "short_conv": 4, **(gla or {})}
    attention = {"num_kv_heads": 2, **(attention or {})}
    if "W" in pattern or swa is not None:
      swa = {"num_kv_heads": 2, **(swa or {})}
    if "M" in pattern or mom is not None:
      mom = {"chunk_size": 16, "short_conv": 4, **(mom or {})}
    if "D" in pattern or gdn is not None:
      gdn = {"chunk_size": 16, **(gdn or {})}
  mlp = {"transformer": s.transformer_mlp, "mom": s.mom_mlp}.get(variant, s.mlp)
  return ModelConfig.create(
      pattern=pattern, vocab_size=vocab_size, hidden=s.hidden, num_heads=s.heads,
      mlp_dim=mlp, sse=sse, gla=gla, attention=attention, swa=swa, mom=mom, gdn=gdn,
      **kwargs)


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
