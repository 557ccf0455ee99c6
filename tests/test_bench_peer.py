"""The fla peer benchmark measures the ops the JAX benchmark measures, and nothing else
(each of fla's ops autotunes for minutes on its first call)."""

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)


def test_bench_ops_passes_only_the_ops_it_measures():
  code = ("from absl import flags; from experiments import bench_ops; "
          "flags.FLAGS(['x', {}]); print(bench_ops.peer_ops())")
  done = _run(code.format("'--gla_impls=', '--sse_impls='"))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "['gdn', 'sse_gdn']"
  done = _run(code.format("'--gdn_impls=', '--sse_gdn_impls=', '--sse_impls='"))
  assert done.stdout.strip() == "['gla']", done.stderr[-2000:]


def test_bench_fla_refuses_an_unknown_op_before_importing_torch():
  done = subprocess.run([sys.executable, "-m", "experiments.bench_fla", "--out=unused.json",
                         "--ops=gdn,delta"], capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert "--ops='gdn,delta': choose from gla,sse,gdn,sse_gdn" in done.stderr
  assert "importing torch" not in done.stderr
