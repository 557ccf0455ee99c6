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


def _assert_refused(module: str, arg: str, message: str):
  """`python -m module arg` exits 2 with `message`, before importing torch."""
  done = subprocess.run([sys.executable, "-m", module, "--out=unused", arg],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert message in done.stderr
  assert "importing torch" not in done.stderr


def test_bench_fla_refuses_an_unknown_op_before_importing_torch():
  _assert_refused("experiments.bench_fla", "--ops=gdn,delta",
                  "--ops='gdn,delta': choose from gla,sse,gdn,sse_gdn")


def test_bench_fla_e2e_refuses_an_unknown_variant_before_importing_torch():
  _assert_refused("experiments.bench_fla_e2e", "--variants=gla,gdn",
                  "--variants='gla,gdn': choose from gla,sse")


def test_load_layer_skips_the_layers_package_init(tmp_path):
  """fla.layers' __init__ imports every layer (some need transformers): load_layer reads
  one layer file without it, and names the missing authors' file in one line."""
  layers = tmp_path / "fla" / "layers"
  layers.mkdir(parents=True)
  (tmp_path / "fla" / "__init__.py").write_text("")
  (layers / "__init__.py").write_text("raise ImportError('the package init ran')\n")
  (layers / "utils.py").write_text("HELPER = 7\n")
  (layers / "gla.py").write_text("from fla.layers.utils import HELPER\nLAYER = HELPER * 6\n")
  code = ("import sys; sys.path.insert(0, {root!r}); from experiments import bench_fla_e2e as b; "
          "print(b.load_layer('gla').LAYER)\n"
          "try:\n  b.load_layer('sse')\nexcept FileNotFoundError as e:\n  print(e)")
  done = _run(code.format(root=str(tmp_path)))
  assert done.returncode == 0, done.stderr[-2000:]
  first, second = done.stdout.strip().splitlines()
  assert first == "42"
  assert second.endswith("copy its fla/layers/sse.py and fla/ops/sse/ over the installed fla")
  assert "sse.py not found" in second
