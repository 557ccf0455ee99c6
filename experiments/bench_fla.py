r"""Peer timings in PyTorch: fla's `chunk_gla` and `chunk_gated_delta_rule`, and the SSE
ops built on them.

    python -m experiments.bench_fla --out=results/bench_ops/bench_fla.json

Run by `experiments.bench_ops` in a separate process (PyTorch and JAX then do not
share the GPU's memory pools). Needs torch with CUDA and `fla` (flash-linear-attention
0.6.0). The SSE ops follow the authors' layer (fla pull request #882):
  mask:   replicate q/k/v/g over the N routed + 1 shared partitions, zero k and q and
          set g = 0 where a partition is not selected, fold partitions into heads, one
          `chunk_gla` call, sum over partitions;
  varlen: sort (token, partition) slots by (sequence, partition, position), drop empty
          segments, prepend the shared partition's sequences, one varlen `chunk_gla`
          call, scatter-add the outputs back.
  gdn_varlen: the authors' SSE-GDN varlen op (`SSEGDN.sse_linear_attention_varlen` with
          its `sort_along_l`, fla pull request #882, commit bf82e82): (token, partition)
          slots sorted by (sequence, partition, position), q and k multiplied by the
          router weight, the shared partition's sequences first, one varlen
          `chunk_gated_delta_rule` call with `use_qk_l2norm_in_kernel=True`, outputs
          added back with index_add. (That L2 norm divides the weight out again: see
          docs/design.md, section 7.)
The delta-rule rows take L2-normalised keys (our ops do not normalise: the same
numbers either way), one log decay per head (logsigmoid / 16) and beta = sigmoid(N(0, 1)),
as bench_ops' gdn / sse_gdn rows do. --ops names the ops measured (bench_ops passes the
ones it measures itself: fla's first call of each op autotunes for minutes).
Same setting and timing rule as bench_ops: bf16, cu_seqlens = [0, L/2, L], median of
CUDA-event-timed forward+backward runs after warm-up.

fla 0.6.0 refuses its gated chunk backward (`chunk_bwd_dqkwg`, which both delta-rule
rows call) on Hopper GPUs with Triton 3.4 - 3.7.0, saying that Triton miscompiles it
(fla issue #640). With --triton_guard=time (the default) this benchmark lifts that
refusal to time the kernels anyway, says so in each delta-rule row's "note", and at
--check_length measures how far fla's GDN output and gradients are from a float32
token-by-token recurrence in PyTorch ("errors", the relative-norm errors bench_ops
reports for its own rows). --triton_guard=refuse keeps fla's refusal.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

_T0 = time.perf_counter()
# Inputs whose gradients the timed backward computes (the shared partition's q', k' too).
OPS = ("gla", "sse", "gdn", "sse_gdn")  # the ops this peer benchmark has rows for
GRAD_NAMES = ("q", "k", "v", "g", "w", "q0", "k0", "kn", "k0n", "gh", "beta")


def progress(msg):
  """Timestamped progress on stderr: fla's first calls compile and autotune for minutes."""
  print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gdn_recurrence(q, k, v, g, beta, bounds):
  """The gated delta rule token by token in float32, the definition fla's GDN is
  checked against: per sequence [bounds[i], bounds[i+1]) from S = 0,
  S = exp(g_t) S; S += beta_t k_t^T (v_t - k_t S); o_t = Dk^-1/2 q_t S.

  q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H] (torch tensors); returns o [T, H, Dv].
  """
  import torch  # pylint: disable=g-import-not-at-top
  q, k, v, g, beta = (a.float() for a in (q, k, v, g, beta))
  outs = []
  for start, end in zip(bounds[:-1], bounds[1:]):
    s = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    for t in range(start, end):
      s = s * g[t].exp()[:, None, None]
      u = v[t] - torch.einsum("hk,hkv->hv", k[t], s)
      s = s + beta[t][:, None, None] * k[t][:, :, None] * u[:, None, :]
      outs.append(torch.einsum("hk,hkv->hv", q[t], s) * q.shape[2] ** -0.5)
  return torch.stack(outs)


def lift_triton_guard():
  """Lets fla run its gated chunk backward where it refuses to (module docstring);
  returns the note for the rows that use it, or None where fla does not refuse."""
  from fla.ops.common import chunk_o  # pylint: disable=g-import-not-at-top
  if not (chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0
          and not chunk_o.TRITON_ABOVE_3_7_1):
    return None
  import triton  # pylint: disable=g-import-not-at-top
  chunk_o.TRITON_ABOVE_3_7_1 = True  # the refusal's only input that is not the hardware
  note = (f"timed despite fla's refusal: its gated chunk backward is flagged incorrect on "
          f"Hopper with Triton {triton.__version__} (fla #640)")
  progress(note)
  return note


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--lengths", default="2048,8192,32768")
  parser.add_argument("--partitions", default="4,8,16")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--top_k", type=int, default=1)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--check_length", type=int, default=2048,
                      help="length at which fla's GDN is checked against a float32 recurrence "
                           "(0: no check)")
  parser.add_argument("--triton_guard", choices=("time", "refuse"), default="time",
                      help="on Hopper with Triton 3.4 - 3.7.0, time fla's gated chunk backward "
                           "despite its refusal (rows say so) or keep the refusal")
  parser.add_argument("--ops", default=",".join(OPS),
                      help=f"comma-separated subset of {','.join(OPS)}: the ops measured")
  args = parser.parse_args()
  ops = args.ops.split(",") if args.ops else []
  unknown = [op for op in ops if op not in OPS]
  if unknown or not ops:
    parser.error(f"--ops={args.ops!r}: choose from {','.join(OPS)}")

  progress("importing torch")
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  progress(f"importing fla (torch {torch.__version__})")
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # pylint: disable=g-import-not-at-top
  from fla.ops.gla import chunk_gla  # pylint: disable=g-import-not-at-top
  progress("fla imported")
  guard_note = None
  if args.triton_guard == "time" and {"gdn", "sse_gdn"} & set(ops):
    guard_note = lift_triton_guard()

  dev = "cuda"
  h, d, top_k = args.heads, args.dim, args.top_k

  def inputs(length, n):
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)
    shape = (1, length, h, d)
    x = dict(q=rnd(*shape).bfloat16(), k=rnd(*shape).softmax(-1).bfloat16(),
             v=rnd(*shape).bfloat16(), g=F.logsigmoid(rnd(*shape)) / 16,
             q0=rnd(*shape).bfloat16(), k0=rnd(*shape).softmax(-1).bfloat16(),
             cot=rnd(*shape).bfloat16())
    w, idx = rnd(1, length, n).softmax(-1).topk(top_k, dim=-1)
    x.update(w=w, idx=idx, cu=torch.tensor([0, length // 2, length], device=dev))
    # The delta rule: unit keys, a log decay and a write strength per head.
    unit = lambda a: F.normalize(a.float(), dim=-1).bfloat16()
    x.update(kn=unit(rnd(*shape)), k0n=unit(rnd(*shape)),
             gh=F.logsigmoid(rnd(1, length, h)) / 16, beta=rnd(1, length, h).sigmoid())
    for name in GRAD_NAMES:  # our op also differentiates the shared partition's q', k'
      x[name].requires_grad_(True)

    return x

  def dense(x, n):
    del n
    return chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=x["cu"])[0]

  def mask(x, n):
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    onehot = F.one_hot(x["idx"], n).to(torch.float32)                      # [1,T,K,N]
    sel = onehot.sum(2)
    wd = (onehot * x["w"][..., None]).sum(2)
    col = lambda a: a[..., None, None]
    qm = torch.cat([(q[:, :, None] * col(wd)).bfloat16(), x["q0"][:, :, None]], 2)
    km = torch.cat([(k[:, :, None] * col(wd)).bfloat16(), x["k0"][:, :, None]], 2)
    gm = torch.cat([g[:, :, None] * col(sel), g[:, :, None]], 2)
    vm = v[:, :, None].expand(-1, -1, n + 1, -1, -1)
    t = q.shape[1]
    fold = lambda a: a.reshape(1, t, (n + 1) * h, -1)
    o = chunk_gla(fold(qm), fold(km), fold(vm.contiguous()), fold(gm), cu_seqlens=x["cu"])[0]
    return o.view(1, t, n + 1, h, -1).sum(2)

  def varlen(x, n):
    q, k, v, g, w, idx, cu = x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["w"][0], x["idx"][0], x["cu"]
    t = q.shape[0]
    seq = torch.searchsorted(cu[1:], torch.arange(t, device=dev), right=True)
    key = (seq[:, None] * n + idx).reshape(-1)                            # [T*K]
    order = torch.sort(key, stable=True).indices
    tok = order // top_k
    counts = torch.bincount(key, minlength=(cu.numel() - 1) * n)
    counts = counts[counts > 0]
    wflat = w.reshape(-1)[order][:, None, None]
    qp = torch.cat([x["q0"][0], (q[tok] * wflat).bfloat16()])
    kp = torch.cat([x["k0"][0], (k[tok] * wflat).bfloat16()])
    vp = torch.cat([v, v[tok]])
    gp = torch.cat([g, g[tok]])
    cu_p = torch.cat([cu, t + torch.cumsum(counts, 0)])
    op = chunk_gla(qp[None], kp[None], vp[None], gp[None], cu_seqlens=cu_p)[0][0]
    out = op[:t].float().index_add(0, tok, op[t:].float())
    return out[None].bfloat16()

  def dense_gdn(x, n):
    del n
    return chunk_gated_delta_rule(x["q"], x["kn"], x["v"], x["gh"], x["beta"],
                                  cu_seqlens=x["cu"])[0]

  def gdn_varlen(x, n):
    """The authors' SSE-GDN varlen op (module docstring), written out for K = Kw = Kr
    and B = 1 with cu_seqlens, as their layer calls it in training (eta: the top-k
    router probabilities, here w; emulq = emulk = True)."""
    q, k, v, g, b, w, idx, cu = (x["q"][0], x["kn"][0], x["v"][0], x["gh"][0], x["beta"][0],
                                 x["w"][0], x["idx"][0], x["cu"])
    t = q.shape[0]
    seq = torch.searchsorted(cu[1:], torch.arange(t, device=dev), right=True)
    key = (seq[:, None] * n + idx).reshape(-1)                            # [T*K]
    order = torch.sort(key, stable=True).indices                          # time order kept
    tok = order // top_k
    counts = torch.bincount(key, minlength=(cu.numel() - 1) * n)
    counts = counts[counts > 0]
    eta = w.reshape(-1)[order].to(q.dtype)[:, None, None]
    qp = torch.cat([x["q0"][0], q[tok] * eta])
    kp = torch.cat([x["k0n"][0], k[tok] * eta])
    vp = torch.cat([v, v[tok]])
    gp = torch.cat([g, g[tok]])
    bp = torch.cat([b, b[tok]])
    cu_p = torch.cat([cu, t + torch.cumsum(counts, 0)])
    op = chunk_gated_delta_rule(qp[None], kp[None], vp[None], gp[None], bp[None],
                                cu_seqlens=cu_p, use_qk_l2norm_in_kernel=True)[0][0]
    out = op[:t].clone()
    out.index_add_(0, tok, op[t:])
    return out[None]

  def gdn_errors(x):
    """Relative errors of fla's GDN output and gradients against `gdn_recurrence`."""
    names = ("q", "kn", "v", "gh", "beta")
    grads = {}
    reference = lambda x, n: gdn_recurrence(
        *(x[name][0] for name in ("q", "kn", "v", "gh", "beta")), x["cu"].tolist())[None]
    for label, fn in (("fla", dense_gdn), ("ref", reference)):
      for name in GRAD_NAMES:
        x[name].grad = None
      o = fn(x, None)
      (o.float() * x["cot"].float()).sum().backward()
      grads[label] = [o.detach().float()] + [x[name].grad.float() for name in names]
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))
    return {label: rel(a, b) for label, a, b in
            zip(("o", "dq", "dk", "dv", "dg", "dbeta"), grads["fla"], grads["ref"])}

  def time_fb(fn, x, n):
    progress(f"{fn.__name__} L={x['q'].shape[1]} N={n}: first calls (compile, autotune)")

    def run():
      for name in GRAD_NAMES:
        x[name].grad = None
      o = fn(x, n)
      (o.float() * x["cot"].float()).sum().backward()
    for _ in range(3):
      run()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      run()
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end))
    return statistics.median(times)

  rows = []

  def save():  # after every row: a run stopped by a time limit keeps what it measured
    tmp = pathlib.Path(args.out + ".tmp")  # then renamed: a kill never leaves half a file
    tmp.write_text(json.dumps(dict(rows=rows), indent=1))
    tmp.replace(args.out)
  dense_ops = tuple(o for o in (("gla", "chunk_gla", dense),
                                 ("gdn", "chunk_gated_delta_rule", dense_gdn))
                    if o[0] in ops)
  sse_ops = tuple(o for o in (("sse", "fla_mask", mask), ("sse", "fla_varlen", varlen),
                              ("sse_gdn", "authors_gdn_varlen", gdn_varlen))
                  if o[0] in ops)
  for length in (int(v) for v in args.lengths.split(",")):
    x = inputs(length, 4)
    for op, name, fn in dense_ops:
      ms = time_fb(fn, x, 4)
      row = dict(source="fla (torch)", op=op, impl=name, length=length, n=None,
                 fwd_bwd_ms=ms)
      if op == "gdn" and guard_note:
        row["note"] = guard_note
      if op == "gdn" and length == args.check_length:
        progress(f"checking {name} at L={length} against a float32 recurrence")
        row["errors"] = gdn_errors(x)
      rows.append(row)
      print(f"fla {name} L={length} fwd+bwd {ms:.3f} ms"
            + (f"  err {row['errors']}" if "errors" in row else ""), flush=True)
      save()
    for n in (int(v) for v in args.partitions.split(",")):
      x = inputs(length, n)
      for op, name, fn in sse_ops:
        ms = time_fb(fn, x, n)
        rows.append(dict(source="fla (torch)", op=op, impl=name, length=length, n=n,
                         fwd_bwd_ms=ms, **({"note": guard_note}
                                            if op == "sse_gdn" and guard_note else {})))
        print(f"fla {op} {name} L={length} N={n} fwd+bwd {ms:.3f} ms", flush=True)
        save()


if __name__ == "__main__":
  main()
