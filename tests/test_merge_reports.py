"""experiments.merge_reports: one report from the pieces of a sweep, refusing pieces
that trained something else."""

import json
import subprocess
import sys

import pytest

from configs import fig7
from configs import table6
from experiments import merge_reports

FLAGS = "--config.train.num_steps=8 --config.lrs=(0.003,) --config.seeds=(0, 1)"


def _command(config="configs/fig7.py:cpu", flags=FLAGS):
  return f"python -m experiments.ablation --config={config} {flags} --results=somewhere"


def _row(run, labels, step, finished, values):
  curve = [dict(step=s, eval_accuracy=v) for s, v in ((step // 2, 0.1), (step, values[0]))]
  return dict(run=run, labels=labels, lr=0.003, lr_eval_loss={"0.003": 1.0}, seeds=2,
              seeds_used=[0, 1], metric=sum(values) / 2, values=values,
              metric_std=abs(values[0] - values[1]) / 2, eval_loss=1.0, finished=finished,
              step=step, jobs=2, jobs_missing=0, lr_seeds={"0.003": [0, 1]}, params=10,
              tokens_per_s=1.0, wall_time_s=1.0, curves=[curve, curve])


def _report(path, name, rows, command):
  path.mkdir(parents=True)
  (path / "results.json").write_text(json.dumps(dict(
      name=name, description="", metric="eval_accuracy", command=command, paper={},
      rows=rows)))
  return str(path)


def _config(module=fig7, steps=8):
  cfg = module.get_config("cpu")
  cfg.train.num_steps, cfg.lrs, cfg.seeds = steps, (0.003,), (0, 1)
  return cfg


N1 = dict(N=1, k=1, ratio="all")
N4 = dict(N=4, k=1, ratio=0.25)


def test_command_parsing_keeps_values_with_spaces():
  cfg = merge_reports.config_of_command(_command())
  assert cfg.name == "fig7_cpu"
  assert cfg.seeds == (0, 1) and cfg.lrs == (0.003,) and cfg.train.num_steps == 8


def test_merge_takes_the_last_finished_row_else_the_furthest(tmp_path):
  a = _report(tmp_path / "a", "fig7_cpu",
              [_row("N1_k1", N1, 8, True, [0.5, 0.6]), _row("N4_k1", N4, 4, False, [0.2, 0.3])],
              _command())
  b = _report(tmp_path / "b", "fig7_cpu",
              [_row("N1_k1", N1, 8, True, [0.7, 0.9]), _row("N4_k1", N4, 6, False, [0.4, 0.2])],
              _command())
  c = _report(tmp_path / "c", "fig7_cpu", [_row("N1_k1", N1, 6, False, [0.1, 0.1])],
              _command())
  rows, used = merge_reports.merge(_config(), [a, b, c], [])
  assert [r["run"] for r in rows] == ["N1_k1", "N4_k1"]
  assert rows[0]["values"] == [0.7, 0.9] and used[0].report.name == "b"  # later finished
  assert rows[1]["values"] == [0.4, 0.2] and rows[1]["step"] == 6  # furthest unfinished
  assert not rows[1]["finished"]


def test_a_source_trained_with_other_flags_is_refused(tmp_path):
  a = _report(tmp_path / "a", "fig7_cpu", [_row("N1_k1", N1, 8, True, [0.5, 0.6])],
              _command(flags=FLAGS + " --config.train.batch_size=3"))
  with pytest.raises(ValueError, match=r"batch_size: 3 in the report, \d+ in this config"):
    merge_reports.merge(_config(), [a], [])
  b = _report(tmp_path / "b", "fig7_cpu", [_row("N1_k1", N1, 8, True, [0.5, 0.6])],
              _command())
  with pytest.raises(ValueError, match="num_steps: 8 in the report, 16 in this config"):
    merge_reports.merge(_config(steps=16), [b], [])


def test_a_report_of_another_sweep_needs_borrow(tmp_path):
  a = _report(tmp_path / "a", "fig7_cpu", [_row("N4_k1", N4, 8, True, [0.5, 0.6])],
              _command())
  with pytest.raises(ValueError, match="sweep 'fig7_cpu', not 'table6_cpu'"):
    merge_reports.merge(_config(table6), [a], [])


def test_borrow_accepts_the_same_model_and_refuses_another(tmp_path):
  base = _report(tmp_path / "fig7", "fig7_cpu", [_row("N4_k1", N4, 8, True, [0.5, 0.6])],
                 _command())
  rows, _ = merge_reports.merge(_config(table6), [], [f"softmax=N4_k1@{base}"])
  assert rows[0]["run"] == "softmax" and rows[0]["values"] == [0.5, 0.6]
  assert rows[0]["labels"] == {"family": "sse", "variant": "SSE key softmax"}  # this sweep's
  with pytest.raises(ValueError, match="key_activation: 'softmax' in the report, 'silu'"):
    merge_reports.merge(_config(table6), [], [f"silu=N4_k1@{base}"])


def test_cli_writes_the_report_with_its_sources(tmp_path):
  gla = lambda dk, values: _row(f"GLA_dk{dk}", dict(family="gla", key_dim=dk), 8, True,
                                values)
  a = _report(tmp_path / "a", "fig7_cpu", [_row("N1_k1", N1, 8, True, [0.5, 0.6]),
                                           gla(4, [0.1, 0.2])], _command())
  b = _report(tmp_path / "b", "fig7_cpu", [_row("N4_k1", N4, 8, True, [0.7, 0.8]),
                                           gla(32, [0.9, 1.0])], _command())
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "experiments.merge_reports", "--config=configs/fig7.py:cpu",
         "--config.train.num_steps=8", "--config.lrs=(0.003,)", "--config.seeds=(0, 1)",
         f"--reports={a},{b}", f"--out={out}"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  merged = json.loads((out / "results.json").read_text())
  assert [(r["run"], r["values"]) for r in merged["rows"]] == [
      ("GLA_dk4", [0.1, 0.2]), ("GLA_dk32", [0.9, 1.0]), ("N1_k1", [0.5, 0.6]),
      ("N4_k1", [0.7, 0.8])]
  md = (out / "results.md").read_text()
  assert f"- N4_k1: `{b}`, run N4_k1, step 8" in md
  assert "Not in any report: GLA_dk8, N8_k2" in md
  # The controls come from two sources, and the merged report still gives their verdict.
  verdict = md[md.index("## Verdict"):]
  assert "gap +0.800, min_gap 0.200 -> capacity-bound: yes" in verdict
  assert (out / "fig7_cpu.png").stat().st_size > 0
  bad = subprocess.run(cmd[:-2] + [f"--reports={a}", "--config.train.num_steps=9",
                                   f"--out={out}"], capture_output=True, text=True,
                       timeout=300)
  assert bad.returncode != 0 and "num_steps: 8 in the report, 9 in this config" in bad.stderr


def test_importing_defines_no_flags_that_could_clash():
  # Other experiments define --out at import; in one pytest process both are imported.
  from absl import flags  # pylint: disable=g-import-not-at-top
  assert "reports" not in flags.FLAGS and "borrow" not in flags.FLAGS
