r"""Peer training throughput in PyTorch: language models built from fla's GLA layer and
from the authors' SSE layer, the shape of `experiments.throughput`'s 125M models.

    python -m experiments.bench_fla_e2e --out=results/throughput/peer

Run it on the same GPU in the same session as `experiments.throughput` (the README of
results/throughput gives the pair of commands). Needs torch with CUDA and fla
(flash-linear-attention 0.6.0); the "sse" variant also needs the authors' layer, fla
pull request #882 at commit bf82e82: its `fla/layers/sse.py` and `fla/ops/sse/` copied
over the installed fla. fla's `fla.layers` package imports every layer it has, some of
them through `transformers`, which these two do not use: the two layer modules are
loaded from their files without that package's `__init__` (`load_layer`).

The model (each variant alike but for the mixer): token embedding [V, D] tied with the
output, L blocks of pre-norm x + mixer(RMSNorm(x)), x + SwiGLU(RMSNorm(x)) (fla's
`GatedMLP`, intermediate size I), a final RMSNorm, the logits h E^T and fla's fused
cross-entropy. Mixers, H heads of D / H:
  gla  fla's `GatedLinearAttention` (expand_k = expand_v = 1, rank-16 decay gate,
       logit normaliser 16, output gate with fused RMSNorm; fla's defaults otherwise);
  sse  the authors' `SSEGLA` (sse_implementation="varlen", N partitions, one writer and
       one reader, softmax keys, both gates; its defaults otherwise), its load-balance
       loss added with coefficient 0.01 as in ours.
Training: fp32 parameters, bf16 autocast, `torch.optim.AdamW(fused=True)` (lr 3e-4,
weight decay 0.1), global-norm clipping at 1, random tokens, batch = tokens / T. The
first steps compile and autotune fla's Triton kernels (minutes): --warmup steps are run
and not timed, then the median of --steps timed steps is reported, with the peak of
`torch.cuda.max_memory_allocated` over those steps. Writes <out>/peer.json after each
point (a run stopped at a time limit keeps what it measured) and prints one JSON line
per point.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import shlex
import statistics
import sys
import time
import types

from experiments.bench_fla import progress

VARIANTS = ("gla", "sse")
SIZES = {"125m": dict(layers=12, hidden=768, heads=6, mlp=2048)}  # throughput's 125m
AUX_LOSS_COEF = 0.01  # ours (ModelConfig.aux_loss_coef)


def load_layer(module: str):
  """Imports fla.layers.<module> without running fla/layers/__init__.py (which imports
  every layer, some through transformers): a bare package object stands in for it."""
  import fla  # pylint: disable=g-import-not-at-top
  name = f"fla.layers.{module}"
  if name in sys.modules:
    return sys.modules[name]
  layers_dir = pathlib.Path(fla.__file__).parent / "layers"
  if not (layers_dir / f"{module}.py").exists():
    raise FileNotFoundError(
        f"{layers_dir / (module + '.py')} not found: the 'sse' variant needs fla pull request "
        "#882 (commit bf82e82): copy its fla/layers/sse.py and fla/ops/sse/ over the installed fla")
  package = sys.modules.get("fla.layers")
  if package is None or not hasattr(package, "__path__"):
    package = types.ModuleType("fla.layers")
    package.__path__ = [str(layers_dir)]
    sys.modules["fla.layers"] = package
  spec = importlib.util.find_spec(name)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


def build_model(variant: str, size: dict, vocab: int, partitions: int):
  """The PyTorch LM of `variant` (module docstring); returns an nn.Module whose
  forward(tokens [B, T], targets [B, T]) is the mean loss."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  from fla.modules import FusedCrossEntropyLoss, GatedMLP, RMSNorm  # pylint: disable=g-import-not-at-top

  d, h = size["hidden"], size["heads"]
  if variant == "gla":
    cls = load_layer("gla").GatedLinearAttention
    mixer = lambda i: cls(mode="chunk", hidden_size=d, expand_k=1.0, expand_v=1.0,
                          num_heads=h, gate_low_rank_dim=16, gate_logit_normalizer=16,
                          layer_idx=i)
  elif variant == "sse":
    cls = load_layer("sse").SSEGLA
    mixer = lambda i: cls(hidden_size=d, head_dim=d // h, num_heads=h, expand_v=1.0,
                          mode="chunk", num_sparse_partition=partitions, num_writer=1,
                          num_reader=1, sse_implementation="varlen", layer_idx=i)
  else:
    raise ValueError(f"variant={variant!r}: choose from {', '.join(VARIANTS)}")

  class Block(nn.Module):

    def __init__(self, i):
      super().__init__()
      self.mixer_norm = RMSNorm(d)
      self.mixer = mixer(i)
      self.mlp_norm = RMSNorm(d)
      self.mlp = GatedMLP(hidden_size=d, intermediate_size=size["mlp"], hidden_act="swish")

    def forward(self, x):
      out = self.mixer(self.mixer_norm(x))
      # GatedLinearAttention: (o, None, cache); SSEGLA: (o, (None, aux_loss), cache).
      aux = out[1][1] if isinstance(out[1], tuple) else None
      x = x + out[0]
      return x + self.mlp(self.mlp_norm(x)), aux

  class LM(nn.Module):

    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(vocab, d)
      self.blocks = nn.ModuleList(Block(i) for i in range(size["layers"]))
      self.norm = RMSNorm(d)
      self.loss = FusedCrossEntropyLoss(inplace_backward=True)

    def forward(self, tokens, targets):
      x = self.embed(tokens)
      aux_total = 0.0
      for block in self.blocks:
        x, aux = block(x)
        if aux is not None:
          aux_total = aux_total + aux
      logits = self.norm(x) @ self.embed.weight.t()
      loss = self.loss(logits.view(-1, vocab), targets.view(-1))
      return loss + AUX_LOSS_COEF * aux_total

  return LM().to(device="cuda", dtype=torch.float32)


def measure(variant: str, length: int, args) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  batch = max(1, args.tokens // length)
  torch.manual_seed(0)
  model = build_model(variant, SIZES[args.size], args.vocab, args.partitions)
  model.train()
  params = sum(p.numel() for p in model.parameters())
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
  gen = torch.Generator(device="cuda").manual_seed(1)
  tokens = torch.randint(1, args.vocab, (batch, length + 1), device="cuda", generator=gen)
  inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

  def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = model(inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss

  t0 = time.perf_counter()
  for i in range(args.warmup):
    loss = step()
    torch.cuda.synchronize()
    progress(f"{variant} T={length}: warm-up step {i + 1}/{args.warmup} "
              f"({time.perf_counter() - t0:.0f} s, loss {loss.item():.3f})")
  warmup_s = time.perf_counter() - t0
  torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(args.steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  return dict(variant=variant, length=length, batch=batch, params=params,
              step_s=step_s, tokens_per_s=batch * length / step_s,
              peak_gib=torch.cuda.max_memory_allocated() / 2**30, warmup_s=warmup_s,
              loss=float(loss.item()))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--variants", default="gla,sse")
  parser.add_argument("--lengths", default="2048,8192,32768")
  parser.add_argument("--tokens", type=int, default=65536)  # throughput's default
  parser.add_argument("--size", default="125m", choices=sorted(SIZES))
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--partitions", type=int, default=4)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    parser.error(f"--variants={args.variants!r}: choose from {','.join(VARIANTS)}")
  lengths = [int(t) for t in args.lengths.split(",")]

  progress("importing torch")
  import torch  # pylint: disable=g-import-not-at-top
  import fla  # pylint: disable=g-import-not-at-top
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  report = dict(command="python -m experiments.bench_fla_e2e " + shlex.join(sys.argv[1:]),
                device=torch.cuda.get_device_name(), torch=torch.__version__,
                fla=getattr(fla, "__version__", "?"), rows=[])
  for length in lengths:
    for variant in variants:
      progress(f"{variant} T={length}: building")
      try:
        row = measure(variant, length, args)
      except Exception as e:  # e.g. out of memory, or the authors' layer missing
        row = dict(variant=variant, length=length, error=f"{type(e).__name__}: {e}"[:300])
      report["rows"].append(row)
      (out / "peer.json").write_text(json.dumps(report, indent=1) + "\n")
      print(json.dumps(row), flush=True)
      torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
