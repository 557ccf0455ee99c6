r"""Times each Pallas kernel of the chunked GLA on its own (dense, one segment pair).

    python -m experiments.profile_kernels                     # L = 32K, default tiles
    python -m experiments.profile_kernels --length=8192 --variants="num_warps=8" \
        --variants="sweep_k=16,sweep_v=16"                    # whole core, other tiles

Setting of the op benchmark (bf16, 8 heads, head dim 128, two sequences of L/2 packed
as two segments of whole chunks). For the default `BlockSizes` it times every kernel
separately under `jit` (scores with the gate sums, states -- the fused state walk --
and its unfused form local + sweep, outputs, dv, dq/dk), then the whole core
(`pallas_kernels.chunk_gla.chunk_gla`, forward and forward + backward); each
`--variants` entry (comma-separated BlockSizes fields) times the whole core only, and
compares its output and gradients (o, dq, dk, dv, dg) with the
defaults': max |variant - defaults| / max |defaults| per array, so a variant that is
fast but wrong on this device shows it (same inputs; bf16 rounding differences are
~1e-3). Median of `--reps` runs after warm-up, each ended by `block_until_ready`. The
core excludes what `sse_jax.ops.gla` does around it (segment packing, casts);
`--op_partitions=4,8,16` times that too: the dense op and SSE pallas_varlen against
the core alone on their packed shapes (`op_overhead`); `--walk_partitions=4,16` times
the forms of the state walk on the grids of each op (`walk_grids`).

`--trace_partitions=0,4,16` (with `--nokernels` to skip the rest) records a profiler
trace of fwd + bwd of the dense op (0) and SSE (`--trace_impls`) at each N (with
`--trace_rule=delta`: GDN and SSE-GDN) and prints
the device time of every compiled HLO op (`traces.device_ms_by_op`): which fusions, gathers
or sorts the packing around the kernels costs; `--hlo_dir` writes each program's
optimised HLO to look those names up.

`--gdn_variants` (repeatable; "defaults" for none) traces fwd + bwd of the dense GDN op
(pallas_chunk, the same setting) once per `chunk_gdn.BlockSizes` variant and prints the
device time of each kernel by name, with the largest relative gradient error against the
XLA chunk form in float32 on the same bf16 inputs (`gdn_variants`):

    python -m experiments.profile_kernels --nokernels --gdn_variants=defaults \
        --gdn_variants=split_products=true --gdn_variants=grads_warps=8

Beside each kernel's time (the GLA kernels timed alone, the GDN kernels of the trace) it
prints its achieved bandwidth and matmul throughput (`kernel_work`): the bytes the
kernel must move if it reads each operand and writes each result once, and the FLOPs of
its matrix products (none for the walks, whose loop length is data-dependent), over
its time.

`--interpret` runs the kernels in Pallas interpret mode: a smoke test on CPU, whose
times mean nothing (and no rates are printed). Writes a JSON list of rows to `--out`
when given.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import kernel_work
from experiments import op_setting
from experiments import traces
from pallas_kernels import chunk_gla as kernels

FLAGS = flags.FLAGS
flags.DEFINE_integer("length", 32768, "Tokens L (two segments of L/2).")
flags.DEFINE_integer("heads", 8, "Heads H.")
flags.DEFINE_integer("dim", 128, "Head dim Dk = Dv.")
flags.DEFINE_integer("chunk", 64, "Chunk length C.")
flags.DEFINE_integer("reps", 20, "Timed repetitions (median reported).")
flags.DEFINE_multi_string("variants", [], "BlockSizes overrides, e.g. 'num_warps=8,sweep_k=16'.")
flags.DEFINE_bool("kernels", True, "Time each kernel and the whole core (--nokernels: "
                  "only the extra jobs asked for).")
flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU smoke test).")
flags.DEFINE_string("out", "", "Write the rows as JSON here.")
flags.DEFINE_list("walk_partitions", [], "Also time the state walk (defaults, fused at "
                  "two tile sizes, local + sweep) on the grids of dense GLA and of SSE "
                  "varlen and masking for these N, at --length (walk_grids).")
flags.DEFINE_list("op_partitions", [], "Also time ops.gla / ops.sse pallas_varlen at "
                  "--length against their kernel core alone, for these N (e.g. 4,8,16).")
flags.DEFINE_list("trace_partitions", [], "Also trace fwd + bwd of ops.gla and ops.sse "
                  "pallas_varlen at --length for these N and print the device time of "
                  "each compiled HLO op (op_trace); 0 traces the dense op only.")
flags.DEFINE_enum("trace_rule", "gla", ["gla", "delta"], "The transition --trace_partitions "
                  "traces: gla (ops.gla / ops.sse) or delta (ops.gdn / ops.sse_gdn, with "
                  "bench_ops' delta-rule inputs; --trace_impls then names sse_gdn impls).")
flags.DEFINE_multi_string("gdn_variants", [], "chunk_gdn.BlockSizes variants of the dense "
                          "GDN op to trace per kernel, e.g. 'grads_warps=8' ('defaults').")
flags.DEFINE_list("trace_impls", ["pallas_varlen"], "SSE impls that --trace_partitions "
                  "traces.")
flags.DEFINE_string("hlo_dir", "", "With --trace_partitions: write each traced "
                    "program's optimised HLO here, to look up what a fusion holds.")


def median_ms(fn, *args, reps):
  """`op_setting.time_fn`'s rule (one warm-up run) for a function of several arrays."""
  return op_setting.time_fn(lambda a: fn(*a), args, reps, warmup=1)[0]


def make_inputs(length, heads, dim, chunk):
  """The op benchmark's inputs (`op_setting.make_inputs`), cut into chunks [NC, C, H, D]
  as the kernel core takes them; b = cumsum(g); two segments of L/2."""
  if length % (2 * chunk):
    raise ValueError(f"--length={length} must be a multiple of 2 * chunk = {2 * chunk}")
  nc = length // chunk
  x = op_setting.make_inputs(length, 1, heads, dim, 1)
  x = {name: x[name].reshape((nc, chunk, heads, dim)) for name in ("q", "k", "v", "g", "cot")}
  x["do"] = x.pop("cot")
  x["b"] = jnp.cumsum(x["g"], axis=1)
  x.update(h0=jnp.zeros((2, heads, dim, dim), jnp.float32),
           start=jnp.asarray([0, nc // 2], jnp.int32),
           count=jnp.asarray([nc // 2, nc // 2], jnp.int32))
  return x


def per_kernel(x, bs, interpret, reps):
  """{kernel: ms} of each kernel alone (`kernel_calls`)."""
  return {name: median_ms(fn, *args, reps=reps)
          for name, (fn, args) in kernel_calls(x, bs, interpret).items()}


def per_kernel_work(x, bs):
  """({kernel: bytes}, {kernel: matmul FLOPs or None}) of each kernel of `kernel_calls`
  (`kernel_work`: operands and results once; the compiled kernels, lowered for CUDA)."""
  io, flops = {}, {}
  for name, (fn, args) in kernel_calls(x, bs, False, shapes_only=True).items():
    io[name] = sum(kernel_work.io_bytes(fn, *args).values())
    counts = list(kernel_work.matmul_flops(fn, *args).values())
    flops[name] = None if None in counts else sum(counts)
  return io, flops


def work_rates(io, flops, times) -> dict[str, dict[str, float]]:
  """{"GBps": {kernel: GB/s}, "TFLOPs": {kernel: TFLOP/s}} of the timed kernels."""
  return dict(GBps=kernel_work.rate(io, times), TFLOPs=kernel_work.rate(flops, times, 1e12))


def with_rates(name, ms, rates) -> str:
  """'name 1.234 ms (812 GB/s, 41.0 TFLOP/s)', the rates as far as known."""
  known = [f"{rates[key][name]:{fmt}} {unit}" for key, fmt, unit in (
      ("GBps", ".0f", "GB/s"), ("TFLOPs", ".1f", "TFLOP/s")) if name in rates.get(key, {})]
  return f"{name} {ms:.3f} ms" + (f" ({', '.join(known)})" if known else "")


def kernel_calls(x, bs, interpret, shapes_only=False):
  """{kernel: (jitted fn, args)}, one kernel each; arrays go in as arguments (not as
  baked-in constants). shapes_only: the inputs the later kernels take from the earlier
  ones are only shapes (`jax.eval_shape`; enough to lower the calls, and nothing runs)."""
  k_ = kernels
  start, count = x["start"], x["count"]
  valid = k_._valid_chunks(start, count, x["q"].shape[0])  # pylint: disable=protected-access
  jit = jax.jit
  run = jax.eval_shape if shapes_only else (lambda fn, *args: fn(*args))
  # Inputs of the later kernels, from the earlier ones.
  a, _ = run(jit(lambda q, k, g: k_._scores(q, k, g, bs, interpret)), x["q"], x["k"], x["g"])  # pylint: disable=protected-access
  states = jit(lambda k, v, b, h0, s, c: k_._states(k, v, b, h0, s, c, bs, interpret))  # pylint: disable=protected-access
  h_start, _ = run(states, x["k"], x["v"], x["b"], x["h0"], start, count)
  dstates = jit(lambda q, do, b, h0, s, c: k_._dstates(q, do, b, h0, s, c, bs, interpret))  # pylint: disable=protected-access
  dh, _ = run(dstates, x["q"], x["do"], x["b"], x["h0"], start, count)
  decay = jnp.exp(x["b"][:, -1])
  local = jit(lambda k, b, v: k_._local(k, b, v, bs, interpret, True))  # pylint: disable=protected-access
  fns = {  # pylint: disable=protected-access
      "scores": (jit(lambda q, k, g: k_._scores(q, k, g, bs, interpret)), (x["q"], x["k"], x["g"])),
      "states": (jit(lambda k, b, v, h0, s, c: k_._fused_states(k, b, v, h0, s, c, bs, interpret, False)),
                 (x["k"], x["b"], x["v"], x["h0"], start, count)),
      "local": (local, (x["k"], x["b"], x["v"])),
      "sweep": (jit(lambda d, l, h0, s, c: k_._sweep(d, l, h0, s, c, bs, interpret, False, jnp.float32)),
                (decay, run(local, x["k"], x["b"], x["v"]), x["h0"], start, count)),
      "outputs": (jit(lambda q, v, b, a, h, ok: k_._outputs(q, v, b, a, h, ok, bs, interpret)),
                  (x["q"], x["v"], x["b"], a, h_start, valid)),
      "dv": (jit(lambda k, b, a, do, dh, ok: k_._dv(k, b, a, do, dh, ok, bs, interpret)),
             (x["k"], x["b"], a, x["do"], dh, valid)),
      "dqk": (jit(lambda q, k, b, v, do, h, dh, ok: k_._dqkb(q, k, b, v, do, h, dh, ok, bs, interpret)),
              (x["q"], x["k"], x["b"], x["v"], x["do"], h_start, dh, valid)),
  }
  # The other form of dq/dk (BlockSizes.split_dqk), beside the one bs selects.
  other = dataclasses.replace(bs, split_dqk=not bs.split_dqk)
  fns["dqk_split" if other.split_dqk else "dqk_fused"] = (
      jit(lambda q, k, b, v, do, h, dh, ok: k_._dqkb(q, k, b, v, do, h, dh, ok, other, interpret)),  # pylint: disable=protected-access
      fns["dqk"][1])
  return fns


def whole_core(x, bs, interpret, reps):
  """ms of the core forward and forward + backward (gradients w.r.t. q, k, v, g)."""
  def loss(q, k, v, g, h0, start, count, do):
    o, _ = kernels.chunk_gla(q[None], k[None], v[None], g[None], h0, start, count,
                             block_sizes=bs, interpret=interpret)
    return jnp.sum(o.astype(jnp.float32) * do[None].astype(jnp.float32))
  args = tuple(x[n] for n in ("q", "k", "v", "g", "h0", "start", "count", "do"))
  return dict(fwd=median_ms(jax.jit(loss), *args, reps=reps),
              fwd_bwd=median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))),
                                *args, reps=reps))


def core_outputs(x, bs, interpret) -> dict[str, jax.Array]:
  """The core's output and its gradients for cotangent do, in float32."""
  args = tuple(x[n] for n in ("q", "k", "v", "g"))

  def run(q, k, v, g):
    def core(q, k, v, g):
      return kernels.chunk_gla(q[None], k[None], v[None], g[None], x["h0"], x["start"],
                               x["count"], block_sizes=bs, interpret=interpret)[0][0]
    o, vjp = jax.vjp(core, q, k, v, g)
    return (o, *vjp(x["do"].astype(o.dtype)))

  names = ("o", "dq", "dk", "dv", "dg")
  return {n: a.astype(jnp.float32) for n, a in zip(names, jax.jit(run)(*args))}


def max_rel_diff(got: dict[str, jax.Array], want: dict[str, jax.Array]) -> dict[str, float]:
  """max |got - want| / max |want| per array (0 where want is all zero and got equals it)."""
  out = {}
  for name, w in want.items():
    scale = float(jnp.max(jnp.abs(w)))
    err = float(jnp.max(jnp.abs(got[name] - w)))
    out[name] = err / scale if scale > 0 else err
  return out


def _elementwise_core(q, k, v, g, h0, seg_start, seg_chunks):
  """A stand-in for the chunk core with its signature and next to no cost: the op
  around it is then only the packing (op_overhead)."""
  del seg_start, seg_chunks
  o = (q.astype(jnp.float32) + k.astype(jnp.float32) + g) * v.astype(jnp.float32)
  return o.astype(v.dtype), h0


def _two_sequences(length):
  """Sequence id of each token for cu_seqlens = [0, L/2, L] (bench_ops' setting)."""
  return jnp.repeat(jnp.arange(2), length // 2)


def _varlen_segments(seq, idx, n):
  """SSE varlen's slot segment ids for K = 1 (routed slots, then the shared partition's)
  and their number Z = 2 (N + 1), as `sse_jax.ops.sse` lays them out."""
  return jnp.concatenate([seq * n + idx, 2 * n + seq]), 2 * (n + 1)


def _packed_chunks(seg, z, chunk, heads, dim, seed):
  """The packed layout of slot segments `seg` and random chunked inputs of its shape:
  (layout, NC, dict of q, k, v, do [NC, C, H, D] bf16 and GLA-style g fp32)."""
  from sse_jax.ops import packing  # pylint: disable=g-import-not-at-top
  layout = packing.chunk_layout(seg, z, chunk)
  nc = packing.max_chunks(seg.shape[0], z, chunk)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  shape = (nc, chunk, heads, dim)
  x = {name: jax.random.normal(kk, shape, jnp.bfloat16)
       for name, kk in zip(("q", "k", "v", "do"), keys[:4])}
  x["g"] = jax.nn.log_sigmoid(jax.random.normal(keys[4], shape, jnp.float32)) / 16
  return layout, nc, x


def walk_grids(length, heads, dim, chunk, partitions, interpret, reps):
  """ms of the state walk, forward and reverse, per form, on each op's grid.

  The walk's grid is (Dk / tile, Dv / tile, heads, segments Z): few programs for dense
  GLA (Z = 2), many for SSE varlen (Z = 2 (N + 1) segments of uneven length, here laid
  out from a real routing) and masking (Z = 2, (N + 1) H folded heads). Forms: the
  defaults (BlockSizes.walk_programs picks the tiles), the fused walk with 32 x 32 and
  with 64 x 64 state tiles, and local + sweep (unfused).
  """
  seq = _two_sequences(length)
  grids = [("dense", heads, seq, 2)]
  for n in partitions:
    idx = op_setting.make_inputs(length, n, 1, 16, 1)["idx"][0, :, 0]
    grids.append((f"varlen N={n}", heads, *_varlen_segments(seq, idx, n)))
    grids.append((f"masking N={n}", (n + 1) * heads, seq, 2))
  forms = {"defaults": {},
           "fused 32x32": dict(walk_programs=2**30),
           "fused 64x64": dict(walk_programs=1),
           "local+sweep": dict(fused_states=False)}
  rows = []
  for name, h, seg, z in grids:
    layout, nc, x = _packed_chunks(seg, z, chunk, h, dim, seed=2)
    h0 = jnp.zeros((z, h, dim, dim), jnp.float32)
    args = (x["k"], x["v"], jnp.cumsum(x["g"], axis=1), h0, layout.seg_start,
            layout.seg_chunks)
    for form, fields in forms.items():
      bs = kernels.BlockSizes(chunk=chunk, **fields)
      fwd = jax.jit(lambda k, v, b, h0, s, c, bs=bs: kernels._states(  # pylint: disable=protected-access
          k, v, b, h0, s, c, bs, interpret))
      rev = jax.jit(lambda k, v, b, h0, s, c, bs=bs: kernels._dstates(  # pylint: disable=protected-access
          k, v, b, h0, s, c, bs, interpret))
      rows.append(dict(grid=name, heads=h, segments=z, chunks=nc, form=form,
                       fwd_ms=median_ms(fwd, *args, reps=reps),
                       rev_ms=median_ms(rev, *args, reps=reps)))
      print(f"walk {name:13s} H={h:4d} Z={z:3d} {form:12s}: fwd {rows[-1]['fwd_ms']:.3f} "
            f"ms, reverse {rows[-1]['rev_ms']:.3f} ms", flush=True)
  return rows


def op_overhead(length, heads, dim, chunk, partitions, interpret, reps):
  """What the ops add around the kernel core, fwd + bwd ms, in bench_ops' setting
  (bf16, cu_seqlens = [0, L/2, L], SSE pallas_varlen with the shared partition, K = 1):

    op_ms       the op (ops.gla pallas_chunk, ops.sse pallas_varlen);
    core_ms     the kernel core alone on a buffer of the op's packed shape and with its
                segment table;
    packing_ms  the op with an elementwise stand-in for the core: the packing (sort,
                gathers, their transposes), slot building and casts alone.
  """
  from sse_jax import ops  # pylint: disable=g-import-not-at-top
  # The modules, not the functions of the same names that sse_jax.ops exports.
  gla_lib = importlib.import_module("sse_jax.ops.gla")
  sse_lib = importlib.import_module("sse_jax.ops.sse")
  rows = []
  for n in [None] + list(partitions):
    x = op_setting.make_inputs(length, n or 1, heads, dim, 1)
    seq = _two_sequences(length)
    scale = dim ** -0.5
    if n is None:
      seg, z = seq, 2
      h0 = jnp.zeros((2, heads, dim, dim), jnp.float32)
      def op(q, k, v, g, w):
        return ops.gla(q, k, v, g, cu_seqlens=x["cu"], impl="pallas_chunk")[0]
      def packed(q, k, v, g, w):
        return gla_lib.chunked_gla(q * scale, k, v, g, h0, x["cu"], chunk,
                                   _elementwise_core)[0]
    else:
      seg, z = _varlen_segments(seq, x["idx"][0, :, 0], n)
      h0s = (jnp.zeros((2, n, heads, dim, dim), jnp.float32),
             jnp.zeros((2, heads, dim, dim), jnp.float32))
      def op(q, k, v, g, w, n=n):
        return ops.sse(q, k, v, g, w, x["idx"], num_partitions=n, cu_seqlens=x["cu"],
                       impl="pallas_varlen", shared=(x["q0"], x["k0"], g))[0]
      def packed(q, k, v, g, w, n=n, h0s=h0s):
        routing = sse_lib.make_routing(w, x["idx"], None, None, sse_lib.Gate.BOTH)
        return sse_lib._varlen(  # pylint: disable=protected-access
            q * scale, k, v, g, routing, n, h0s[0], (x["q0"] * scale, x["k0"], g),
            h0s[1], x["cu"], chunk, _elementwise_core)[0]

    def grad_ms(fn):
      loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * x["cot"].astype(jnp.float32))
      return median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))),
                       x["q"], x["k"], x["v"], x["g"], x["w"], reps=reps)

    layout, nc, packed_x = _packed_chunks(seg, z, chunk, heads, dim, seed=1)
    q, k, v, do, g = (packed_x[name][None] for name in ("q", "k", "v", "do", "g"))
    h0 = jnp.zeros((z, heads, dim, dim), jnp.float32)

    def core_loss(q, k, v, g):
      o, _ = kernels.chunk_gla(q, k, v, g, h0, layout.seg_start, layout.seg_chunks,
                               interpret=interpret)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    core_ms = median_ms(jax.jit(jax.value_and_grad(core_loss, argnums=(0, 1, 2, 3))), q, k,
                        v, g, reps=reps)
    rows.append(dict(op="gla" if n is None else "sse", n=n, op_ms=grad_ms(op),
                     core_ms=core_ms, packing_ms=grad_ms(packed), chunks=nc))
  return rows


def op_trace(length, heads, dim, partitions, impls, reps, hlo_dir, rule="gla"):
  """Device time per HLO op of fwd + bwd of the dense op (pallas_chunk, N = 0) and of
  the SSE op with each impl at each N > 0 (op_overhead's setting): which kernels and
  which fusions of the packing the time goes to. rule "gla": ops.gla / ops.sse;
  "delta": ops.gdn / ops.sse_gdn (unit keys, a log decay and beta per head)."""
  from sse_jax import ops  # pylint: disable=g-import-not-at-top
  rows = []
  for n, impl in [(n, impl) for n in partitions for impl in (impls if n else [None])]:
    x = op_setting.delta_inputs(op_setting.make_inputs(length, max(n, 1), heads, dim, 1))
    match rule, n:
      case "gla", 0:
        name, names = "gla", ("q", "k", "v", "g", "w")
        op = lambda q, k, v, g, w: ops.gla(q, k, v, g, cu_seqlens=x["cu"],
                                           impl="pallas_chunk")[0]
      case "gla", _:
        name, names = f"sse_{impl}_n{n}", ("q", "k", "v", "g", "w")
        op = lambda q, k, v, g, w, n=n, impl=impl: ops.sse(
            q, k, v, g, w, x["idx"], num_partitions=n, cu_seqlens=x["cu"], impl=impl,
            shared=(x["q0"], x["k0"], g))[0]
      case "delta", 0:
        name, names = "gdn", ("q", "kn", "v", "gh", "beta")
        op = lambda q, k, v, g, beta: ops.gdn(q, k, v, g, beta, cu_seqlens=x["cu"],
                                              impl="pallas_chunk")[0]
      case "delta", _:
        name, names = f"sse_gdn_{impl}_n{n}", ("q", "kn", "v", "gh", "beta")
        op = lambda q, k, v, g, beta, n=n, impl=impl: ops.sse_gdn(
            q, k, v, g, beta, x["w"], x["idx"], num_partitions=n, cu_seqlens=x["cu"],
            impl=impl, shared=(x["q0"], x["k0n"], g, beta))[0]
      case _:
        raise ValueError(f"unknown rule {rule!r}")
    loss = lambda *a, op=op: jnp.sum(op(*a).astype(jnp.float32) * x["cot"].astype(
        jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = tuple(x[key] for key in names)
    if hlo_dir:
      pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
      (pathlib.Path(hlo_dir) / f"{name}.hlo.txt").write_text(
          step.lower(*args).compile().as_text())
    run = lambda: jax.block_until_ready(step(*args))
    run()
    times = traces.device_ms_by_op(run, reps)
    total = sum(times.values())
    print(f"trace {name}: {total:.3f} ms of device time per fwd + bwd, by HLO op:",
          flush=True)
    for op_name, ms in list(times.items())[:30]:
      print(f"  {ms:8.3f} ms  {op_name}", flush=True)
    rows.append(dict(trace=name, device_ms=total, by_op=times))
  return rows


def gdn_variants(length, heads, dim, chunk, variants, interpret, reps):
  """Per variant ("defaults" or comma-separated chunk_gdn.BlockSizes fields): device ms
  per kernel of fwd + bwd of ops.gdn pallas_chunk (two sequences of L/2, bf16) and the
  largest relative gradient error (dq, dk, dv, dg, dbeta) against ops.gdn "chunk" in
  float32 on the same bf16 values."""
  from pallas_kernels import chunk_gdn  # pylint: disable=g-import-not-at-top
  from sse_jax import ops  # pylint: disable=g-import-not-at-top
  x = op_setting.delta_inputs(op_setting.make_inputs(length, 1, heads, dim, 1))
  args = tuple(x[key] for key in ("q", "kn", "v", "gh", "beta"))
  cot = x["cot"].astype(jnp.float32)

  def grads(impl):
    loss = lambda *a: jnp.sum(ops.gdn(*a, cu_seqlens=x["cu"], impl=impl,
                                      chunk_size=chunk)[0].astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

  # (loss, gradients): the loss keeps o, and so the output kernel, in the program.
  want = grads("chunk")(*(a.astype(jnp.float32) for a in args))[1]
  rows = []
  for variant in variants:
    fields = {} if variant == "defaults" else op_setting.parse_variant(variant)
    bs = chunk_gdn.BlockSizes(chunk=chunk, **fields)
    step = grads(ops.Plan(ops.Algorithm.CHUNK, ops.PallasCore(bs, interpret)))
    got = step(*args)[1]
    errors = {name: op_setting.rel_err(g, w)
              for name, g, w in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want)}
    del got
    run = lambda: jax.block_until_ready(step(*args))
    times = traces.device_ms_by_op(run, reps, by_kernel=True)
    total = sum(times.values())
    rates = {} if interpret else work_rates(kernel_work.io_bytes(step, *args),
                                            kernel_work.matmul_flops(step, *args), times)
    print(f"gdn {variant}: {total:.3f} ms of device time per fwd + bwd; "
          + ", ".join(with_rates(k, v, rates) for k, v in list(times.items())[:12])
          + "; error vs float32: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
          flush=True)
    rows.append(dict(gdn_variant=variant, device_ms=total, by_kernel=times,
                     rates=rates, rel_error=errors))
  return rows


def main(argv):
  del argv
  x = make_inputs(FLAGS.length, FLAGS.heads, FLAGS.dim, FLAGS.chunk)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, L={FLAGS.length}, "
        f"H={FLAGS.heads}, D={FLAGS.dim}, C={FLAGS.chunk}", flush=True)
  rows = []
  configs = ([{}] + [op_setting.parse_variant(v) for v in FLAGS.variants]
             if FLAGS.kernels else [])
  reference = None
  for i, fields in enumerate(configs):
    bs = kernels.BlockSizes(chunk=FLAGS.chunk, **fields)
    times = per_kernel(x, bs, FLAGS.interpret, FLAGS.reps) if i == 0 else {}
    rates = ({} if i or FLAGS.interpret
             else work_rates(*per_kernel_work(x, bs), times))
    times.update(whole_core(x, bs, FLAGS.interpret, FLAGS.reps))
    row = dict(length=FLAGS.length, block_sizes=fields, ms=times, rates=rates)
    line = f"{fields or 'defaults'}: " + ", ".join(
        with_rates(k, v, rates) for k, v in times.items())
    outputs = core_outputs(x, bs, FLAGS.interpret)
    if reference is None:
      reference = outputs
    else:
      row["max_rel_diff_vs_defaults"] = diff = max_rel_diff(outputs, reference)
      line += "; vs defaults: " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items())
    del outputs
    rows.append(row)
    print(line, flush=True)
  if FLAGS.walk_partitions:
    rows += walk_grids(FLAGS.length, FLAGS.heads, FLAGS.dim, FLAGS.chunk,
                       [int(n) for n in FLAGS.walk_partitions], FLAGS.interpret, FLAGS.reps)
  if FLAGS.op_partitions:
    for row in op_overhead(FLAGS.length, FLAGS.heads, FLAGS.dim, FLAGS.chunk,
                           [int(n) for n in FLAGS.op_partitions], FLAGS.interpret,
                           FLAGS.reps):
      rows.append(row)
      print(f"op {row['op']} N={row['n']}: op {row['op_ms']:.3f} ms, core alone "
            f"{row['core_ms']:.3f} ms on {row['chunks']} chunks (op - core "
            f"{row['op_ms'] - row['core_ms']:.3f} ms), packing alone "
            f"{row['packing_ms']:.3f} ms", flush=True)
  if FLAGS.trace_partitions:
    rows += op_trace(FLAGS.length, FLAGS.heads, FLAGS.dim,
                     [int(n) for n in FLAGS.trace_partitions], FLAGS.trace_impls,
                     FLAGS.reps, FLAGS.hlo_dir, FLAGS.trace_rule)
  if FLAGS.gdn_variants:
    rows += gdn_variants(FLAGS.length, FLAGS.heads, FLAGS.dim, FLAGS.chunk,
                         FLAGS.gdn_variants, FLAGS.interpret, FLAGS.reps)
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  app.run(main)
