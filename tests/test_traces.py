"""Profiler traces read back per HLO op (`experiments.traces`) and the training-step
profile built on them (`experiments.profile_step`)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments import profile_step
from experiments import traces


def _inner(a):
  return jnp.tanh(a)  # line of the tanh


def _outer(a):
  return jnp.sum(_inner(a @ a))


def _line_of(fn, text):
  import inspect  # pylint: disable=g-import-not-at-top
  lines, start = inspect.getsourcelines(fn)
  return start + next(i for i, l in enumerate(lines) if text in l)


def test_device_time_is_attributed_to_compiled_hlo_ops():
  """Every op the trace names is an instruction of the compiled program, and together
  they account for time."""
  x = jax.random.normal(jax.random.PRNGKey(0), (384, 384))
  fn = jax.jit(lambda a: jnp.tanh(a @ a @ a))
  run = lambda: jax.block_until_ready(fn(x))
  run()
  times = traces.device_ms_by_op(run, reps=2)
  hlo = fn.lower(x).compile().as_text()
  assert times and sum(times.values()) > 0, times
  for name in times:
    assert f"{name} = " in hlo, (name, times)


def test_sources_of_a_compiled_gradient_name_this_file_and_the_pass():
  """The tanh (forward) and its derivative (backward, a transposed op) of a real compiled
  gradient point at the line that wrote the tanh, whichever metadata format this XLA
  prints."""
  step = jax.jit(jax.grad(_outer))
  hlo = step.lower(jnp.ones((8, 8))).compile().as_text()
  sources = traces.hlo_sources(hlo)
  tanh_line = _line_of(_inner, "jnp.tanh(a)")
  tanh = [s for s in sources.values() if s.op_name.endswith("/tanh")]
  assert tanh and all(s.file.endswith("test_traces.py") and s.line == tanh_line
                      for s in tanh), tanh
  assert {s.phase for s in tanh} == {"forward"}
  dot_line = _line_of(_outer, "a @ a")
  backward = [s for s in sources.values() if s.phase == "backward" and s.line == dot_line]
  assert backward, sorted(set(sources.values()), key=str)[:20]


HANDWRITTEN = """HloModule jit_step, is_scheduled=true

FileNames
1 "/site-packages/flax/nnx/nn/linear.py"
2 "/repo/sse_jax/layers/sse.py"
3 "/site-packages/optax/_src/transform.py"
4 "/repo/sse_jax/train/steps.py"

FunctionNames
1 "step"
2 "attend"
3 "__call__"
4 "update_moment"

FileLocations
1 {file_name_id=4 function_name_id=1 line=40 end_line=40 column=2 end_column=9}
2 {file_name_id=2 function_name_id=2 line=212 end_line=212 column=4 end_column=30}
3 {file_name_id=1 function_name_id=3 line=99 end_line=99 column=4 end_column=30}
4 {file_name_id=3 function_name_id=4 line=7 end_line=7 column=4 end_column=30}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=2}


ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0), metadata={op_name="p"}
  %fusion.7 = f32[4]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(step)/jvp()/dot_general" stack_frame_id=3}
  %fusion.8 = f32[4]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(step)/transpose(jvp())/dot_general" stack_frame_id=3}
  %add.2 = f32[4]{0} add(%p, %p), metadata={op_name="jit(step)/add" stack_frame_id=4}
  %add.4 = f32[4]{0} add(%p, %p), metadata={op_name="jit(step)/optimizer/add" stack_frame_id=1}
  %add.5 = f32[4]{0} add(%p, %p), metadata={op_name="jit(step)/optimizers/add" stack_frame_id=1}
  %old.1 = f32[4]{0} add(%p, %p), metadata={op_name="jit(step)/mul" source_file="/x/pallas_kernels/chunk_gla.py" source_line=17}
  ROOT %copy.3 = f32[4]{0} copy(%p)
}
"""


def test_handwritten_module_attributes_to_the_innermost_owned_frame():
  """A flax matmul called from our layer counts for the layer's file and line (frame 3
  -> parent 2: XLA prints parent ids one above); optax code and ops under the trainer's
  optimizer scope (that exact scope name, not a prefix) are the optimizer; the old
  source_file / source_line form is read too; an op without metadata is absent."""
  s = traces.hlo_sources(HANDWRITTEN)
  assert s["fusion.7"] == traces.Source("jit(step)/jvp()/dot_general",
                                        "sse_jax/layers/sse.py", 212)
  assert s["fusion.7"].phase == "forward" and s["fusion.8"].phase == "backward"
  assert (s["add.2"].file, s["add.2"].line, s["add.2"].phase) == (
      "optax/_src/transform.py", 7, "optimizer")
  assert (s["add.4"].file, s["add.4"].line, s["add.4"].phase) == (
      "sse_jax/train/steps.py", 40, "optimizer")
  assert s["add.5"].phase == "forward"
  assert (s["old.1"].file, s["old.1"].line) == ("pallas_kernels/chunk_gla.py", 17)
  assert "copy.3" not in s
  rows = profile_step.breakdown({"fusion.7": 2.0, "fusion.8": 3.0, "add.2": 1.0,
                                 "copy.3": 0.5}, s)
  table = dict(profile_step.by_file(rows))
  assert table["sse_jax/layers/sse.py"] == {"forward": 2.0, "backward": 3.0, "total": 5.0}
  assert table[profile_step.NO_SOURCE] == {"unknown": 0.5, "total": 0.5}
  assert list(dict(profile_step.by_file(rows)))[0] == "sse_jax/layers/sse.py"


def test_package_path_cuts_at_the_last_package_directory():
  assert traces.package_path("/a/site-packages/optax/_src/alias.py") == "optax/_src/alias.py"
  assert traces.package_path("/w/sse_jax/ops/sse.py") == "sse_jax/ops/sse.py"
  assert traces.package_path("sse_jax/ops/sse.py") == "sse_jax/ops/sse.py"
  assert traces.package_path("/w/tests/t.py") == "/w/tests/t.py"


def test_profile_step_runs_the_trainers_step_and_accounts_for_its_time(tmp_path):
  """A tiny SSE model's step on CPU: the traced time is split into files whose totals
  add up to it, and the SSE layer, its op, the router and the optimizer all appear
  with the pass they belong to."""
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.profile_step", "--size=tiny", "--variants=sse",
       "--lengths=32", "--tokens=64", "--reps=1", "--steps=1", f"--out={tmp_path}"],
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  point = json.loads((tmp_path / "profile_step.json").read_text())["points"][0]
  assert point["init_s"] > 0 and point["compile_s"] > 0
  assert "state created in" in proc.stdout
  files = dict(profile_step.by_file(point["ops"]))
  assert abs(sum(c["total"] for c in files.values()) - point["device_ms"]) < 1e-6
  phases = {(r["file"], r["phase"]) for r in point["ops"]}
  assert {p for f, p in phases if f.startswith("sse_jax/layers/")} == {"forward", "backward"}
  # The update runs under the trainer's optimizer scope, and nothing else does.
  assert {f for f, p in phases if p == "optimizer"} == {"sse_jax/train/steps.py"}, phases
  assert any(f.startswith("sse_jax/ops/") for f in files), list(files)
  assert "sse_jax/layers/router.py" in files, list(files)
  parts = dict(profile_step.by_part(point["ops"]))
  assert abs(sum(c["total"] for c in parts.values()) - point["device_ms"]) < 1e-6
  assert {"router, top-k and load balance", "optimizer and clipping"} <= set(parts)
  report = (tmp_path / "profile_step.md").read_text()
  assert "| router, top-k and load balance |" in report and "By file:" in report
  redraw = tmp_path / "redraw"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.profile_step", f"--out={redraw}",
       f"--from_json={tmp_path / 'profile_step.json'}"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (redraw / "profile_step.md").read_text() == report
  assert report.count("| sse_jax/") >= 3
  assert (tmp_path / "profile_step.png").stat().st_size > 0


def test_parts_of_a_step():
  assert profile_step.part_of("pallas_kernels/chunk_gla.py") == "op: Pallas kernels"
  assert profile_step.part_of("optax/_src/alias.py") == "optimizer and clipping"
  assert profile_step.part_of("sse_jax/train/metrics.py") == "loss"
  assert profile_step.part_of(profile_step.NO_SOURCE) == profile_step.NO_SOURCE
