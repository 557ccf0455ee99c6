"""The ablation runner's sweep mechanics: parallel workers, skipping finished runs, and
reports that show unfinished runs as such."""

import json
import subprocess
import sys

import pytest

from configs import table8
from experiments import ablation
from experiments import dispatch
from experiments import plots
from experiments import report
from experiments import sweep

# Two steps, evaluated at the end only and scored on the validation stream: no
# per-pair-count test set (P = 8 alone took 32 batches of 4 per job and evaluation).
TINY = ["--config.train.num_steps=2", "--config.train.eval_every=2",
        "--config.train.log_every=1", "--config.train.checkpoint_every=2",
        "--config.train.batch_size=4", "--config.train.eval_batches=1",
        "--config.train.warmup_steps=1", "--config.train.progress=False",
        "--config.train.eval_pairs=()", "--config.metric=eval_accuracy"]
# One seed, each job in its own process (the config's own stack / seeds say otherwise).
SINGLE = ["--config.seeds=(0,)", "--config.stack=False"]


def _table8(seeds=(0,)):
  """table8:cpu with one seed, scored by the validation accuracy (the fake runs below
  have no per-pair-count test sets)."""
  cfg = table8.get_config("cpu")
  cfg.seeds, cfg.metric = seeds, "eval_accuracy"
  return cfg


def test_without_drops_flags_in_both_forms():
  argv = ["--config=c.py:cpu", "--workers=4", "--only", "a,b", "--results=r", "--x=1",
          "--report_only", "--noreport_only"]
  assert dispatch.without(argv, ("--workers", "--only", "--results", "--report_only")) == [
      "--config=c.py:cpu", "--x=1"]


def test_parallel_sweep_trains_every_run_and_reports(tmp_path):
  """Two workers train the runs of --only (two of table8's three, one child each) and
  the report lists them; a second call finds them finished."""
  cmd = [sys.executable, "-m", "experiments.ablation", "--config=configs/table8.py:cpu",
         f"--workdir={tmp_path}", "--workers=2", "--only=shared,separate", *TINY, *SINGLE]
  first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
  cfg = table8.get_config("cpu")
  cfg.train.num_steps, cfg.seeds = 2, (0,)
  jobs = [j for j in sweep.expand(cfg, tmp_path / cfg.name) if j.run != "mom"]
  assert len(jobs) == 2
  for job in jobs:  # each child trained its run to the end and logged to train.log
    summary = sweep.read_summary(job)
    assert summary is not None and summary["step"] == 2, job.dir
    assert (job.dir / "train.log").exists()
  results = json.loads((tmp_path / cfg.name / "results.json").read_text())
  assert [r["run"] for r in results["rows"]] == ["shared", "separate"]
  assert all(r["finished"] for r in results["rows"])
  assert "--workers" not in results["command"]
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-2000:]
  assert "2 of 2 runs already finished" in again.stdout


def test_stacked_sweep_trains_each_runs_lrs_and_seeds_in_one_process(tmp_path):
  """--stack groups a run's 2 lrs x 2 seeds into one child process (two of table8's
  three runs trained, --only; the grouping of every run is checked without training)."""
  cmd = [sys.executable, "-m", "experiments.ablation", "--config=configs/table8.py:cpu",
         f"--workdir={tmp_path}", "--workers=2", "--stack", "--config.lrs=(0.003, 0.01)",
         "--config.seeds=(0, 1)", "--only=shared,separate", *TINY]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  cfg = table8.get_config("cpu")
  cfg.train.num_steps, cfg.lrs, cfg.seeds = 2, (0.003, 0.01), (0, 1)
  jobs = sweep.expand(cfg, tmp_path / cfg.name)
  groups = sweep.groups_of(jobs, stack=True)
  assert [len(g) for g in groups] == [4] * len(cfg.runs)
  assert sweep.groups_of(jobs, stack=False) == [[j] for j in jobs]
  trained = [g for g in groups if g[0].run in ("shared", "separate")]
  assert len(trained) == 2
  for group in trained:  # one child per run, its log in the first job's directory
    assert (group[0].dir / "train.log").exists()
    assert not any((j.dir / "train.log").exists() for j in group[1:])
    summaries = [sweep.read_summary(j) for j in group]
    assert all(s is not None and s["step"] == 2 for s in summaries), group[0].dir
    losses = {s["eval"]["loss"] for s in summaries}
    assert len(losses) == 4  # four different runs, not one run copied
  assert all(sweep.read_summary(j) is None for g in groups if g[0].run == "mom" for j in g)
  results = json.loads((tmp_path / cfg.name / "results.json").read_text())
  assert "--stack" in results["command"]
  rows = {r["run"]: r for r in results["rows"]}
  assert all(rows[run]["finished"] and rows[run]["seeds"] == 2 for run in ("shared", "separate"))


def _eval_record(step, loss, accuracy):
  return {"kind": "eval", "step": step, "train_loss": loss, "loss": loss,
          "accuracy": accuracy, "router": []}


def test_unfinished_runs_are_reported_from_their_last_eval(tmp_path):
  cfg = _table8()
  by_run = {job.run: job for job in sweep.expand(cfg, tmp_path)}
  shared, separate = by_run["shared"], by_run["separate"]
  separate.dir.mkdir(parents=True)
  records = [_eval_record(50, 3.0, 0.25), _eval_record(75, 2.0, 0.5)]
  (separate.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  assert report.collect(cfg, [shared, separate])[0]["run"] == "separate"
  row = report.collect(cfg, [shared, separate])[0]
  assert not row["finished"] and row["step"] == 75
  assert row["metric"] == 0.5 and row["eval_loss"] == 2.0
  assert [h["step"] for h in row["curves"][0]] == [50, 75]
  report.write_tables(cfg, [row], tmp_path, "cmd")
  assert f"(unfinished: step 75 of {cfg.train.num_steps})" in (tmp_path / "results.md").read_text()
  # A finished job of the same run takes precedence over the partial log.
  summary = {"step": 100, "finished": True, "eval": _eval_record(100, 1.0, 0.75),
             "history": [], "params": 1}
  (separate.dir / "summary.json").write_text(json.dumps(summary))
  row = report.collect(cfg, [shared, separate])[0]
  assert row["finished"] and row["step"] == 100 and row["metric"] == 0.75


def test_compare_runs_overlays_curves(tmp_path):
  runs = []
  for name, acc in (("a", 0.25), ("b", 0.75)):
    run = tmp_path / name
    run.mkdir()
    lines = [json.dumps({"kind": "train", "step": 10, "loss": 1.0}),
             json.dumps(_eval_record(10, 2.0, acc / 2)), json.dumps(_eval_record(20, 1.0, acc))]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    runs.append(f"{name} run={run}")
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "experiments.compare_runs", f"--out={out}",
                         "--runs=" + ",".join(runs), "--draw=b run",
                         "--reach=eval_accuracy:0.3,eval_accuracy:0.5"], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  curves = json.loads((out / "compare.json").read_text())["runs"]
  assert [h["eval_accuracy"] for h in curves["b run"]] == [0.375, 0.75]
  assert [h["step"] for h in curves["a run"]] == [10, 20]
  assert (out / "compare.png").stat().st_size > 0
  # The table holds every run's last evaluation, drawn or not.
  table = (out / "compare.md").read_text()
  # ... and the first evaluated step at or above each --reach threshold.
  assert "| a run | 20 | 0.2500 | 1.0000 | not by 20 | not by 20 |" in table
  assert "| b run | 20 | 0.7500 | 1.0000 | 10 | 20 |" in table
  assert "first step with eval accuracy >= 0.3 |" in table
  bad = subprocess.run([sys.executable, "-m", "experiments.compare_runs", f"--out={out}",
                        "--runs=" + ",".join(runs), "--draw=c run"], capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode != 0 and "no runs labelled ['c run']" in bad.stderr


def test_several_seeds_report_mean_spread_and_every_seed(tmp_path):
  cfg = _table8(seeds=(0, 1, 2))
  jobs = [j for j in sweep.expand(cfg, tmp_path) if j.run == "shared"]
  for job, acc in zip(jobs, (0.2, 0.9, 0.4)):
    job.dir.mkdir(parents=True)
    summary = {"step": 100, "finished": True, "eval": _eval_record(100, 1.0 - acc, acc),
               "history": [{"step": 100, "eval_accuracy": acc}], "params": 1}
    (job.dir / "summary.json").write_text(json.dumps(summary))
  (row,) = report.collect(cfg, jobs)
  assert row["seeds"] == 3 and row["values"] == [0.2, 0.9, 0.4]
  assert row["metric"] == pytest.approx(0.5) and row["metric_std"] == pytest.approx(0.2944, abs=1e-4)
  assert len(row["curves"]) == 3
  report.write_tables(cfg, [row], tmp_path, "cmd")
  table = (tmp_path / "results.md").read_text()
  assert "| per seed |" in table
  assert "| 0.5000 ± 0.2944 | s0 0.200 / s1 0.900 / s2 0.400 |" in table
  # A seed that did not report is missing by number, not shifted onto another.
  (jobs[1].dir / "summary.json").unlink()
  (row,) = report.collect(cfg, jobs)
  assert row["seeds_used"] == [0, 2] and row["values"] == [0.2, 0.4]
  report.write_tables(cfg, [row], tmp_path, "cmd")
  table = (tmp_path / "results.md").read_text()
  assert "| s0 0.200 / s2 0.400 |" in table
  assert "(1 of 3 lr/seed jobs not finished)" in table and "from its finished jobs" in table
  assert row["jobs_missing"] == 1 and row["lr_seeds"] == {jobs[0].lr: [0, 2]}
  plots.plot(cfg, [row], tmp_path / "fig.png")
  assert (tmp_path / "fig.png").stat().st_size > 0


def test_a_finished_run_of_other_length_or_config_is_refused(tmp_path):
  cfg = table8.get_config("cpu")
  jobs = sweep.expand(cfg, tmp_path)
  jobs[0].dir.mkdir(parents=True)
  summary = {"step": cfg.train.num_steps // 2, "finished": True,
             "eval": _eval_record(1, 1.0, 0.5), "history": []}
  (jobs[0].dir / "summary.json").write_text(json.dumps(summary))
  with pytest.raises(sweep.app.UsageError, match="use another --workdir"):
    sweep.check_finished_runs(jobs)
  summary["step"] = cfg.train.num_steps
  (jobs[0].dir / "summary.json").write_text(json.dumps(summary))
  sweep.check_finished_runs(jobs)  # the same length: fine
  # Its config.json (as the trainer writes it) agrees: fine; another batch size or
  # model width: refused, naming the field; a run-control field (eval_every): fine.
  saved = jobs[0].dir / "config.json"
  saved.write_text(jobs[0].config.to_json_best_effort(indent=2, sort_keys=True))
  sweep.check_finished_runs(jobs)
  for path, value in (("batch_size", 3), ("model.hidden", 24)):
    other = sweep.expand(cfg, tmp_path)
    sweep.set_path(other[0].config, path, value)
    with pytest.raises(sweep.app.UsageError, match=path.replace(".", r"\.")):
      sweep.check_finished_runs(other)
  other = sweep.expand(cfg, tmp_path)
  other[0].config.eval_every = 7
  sweep.check_finished_runs(other)


def test_serial_sweep_goes_on_after_a_failed_run_and_reports_when_interrupted(
    tmp_path, monkeypatch):
  """Serial mode: a failing run (here a stand-in that raises) is reported and the next
  runs still train; Ctrl-C during a run still writes the report of what finished, and
  exits with 130."""
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_train(group, fail=("separate",), interrupt=()):
    job = group[0]
    calls.append(job.run)
    if job.run in fail:
      raise FloatingPointError("non-finite loss at step 3")
    if job.run in interrupt:
      raise KeyboardInterrupt
    for job in group:
      job.dir.mkdir(parents=True, exist_ok=True)
      ev = dict(_eval_record(2, 1.0, 0.5), by_pairs={"8": dict(accuracy=0.5, loss=1.0)})
      summary = {"step": job.config.num_steps, "finished": True, "eval": ev,
                 "history": [], "params": 1}
      (job.dir / "summary.json").write_text(json.dumps(summary))

  cfg = _table8()
  jobs = sweep.expand(cfg, tmp_path)
  monkeypatch.setattr(dispatch, "train_group", fake_train)
  failed = dispatch.train_serially([[j] for j in jobs][::-1])  # the failing run first
  assert calls == [j.run for j in jobs][::-1]
  assert failed == [sweep.job_id(j) for j in jobs if j.run == "separate"]

  monkeypatch.setattr(dispatch, "train_group",
                      lambda g: fake_train(g, fail=(), interrupt=("separate",)))
  argv = ["ablation", "--config=configs/table8.py:cpu", f"--workdir={tmp_path / 'w'}",
          "--workers=1"]
  with flagsaver.flagsaver():
    ablation.FLAGS(argv)
    with pytest.raises(SystemExit) as exit_info:
      ablation.main([])
  assert exit_info.value.code == 130
  report = (tmp_path / "w" / cfg.name / "results.md").read_text()
  assert "shared" in report


def test_a_report_that_cannot_be_written_is_one_line_and_still_lists_the_runs(
    tmp_path, monkeypatch, capsys):
  """A full disk when the report is written (here the figure): one line naming the
  directory and the error on stderr, every run's number on stdout, exit status 1."""
  import errno  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  cfg = _table8()
  jobs = sweep.expand(cfg, tmp_path)
  for job in jobs:
    job.dir.mkdir(parents=True, exist_ok=True)
    ev = dict(_eval_record(2, 1.0, 0.5), by_pairs={"8": dict(accuracy=0.5, loss=1.0)})
    (job.dir / "summary.json").write_text(json.dumps(
        {"step": job.config.num_steps, "finished": True, "eval": ev, "history": [],
         "params": 1}))

  def full_disk(cfg, rows, path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

  monkeypatch.setattr(plots, "plot", full_disk)
  (tmp_path / cfg.name).mkdir(exist_ok=True)
  with pytest.raises(SystemExit) as exit_info:
    ablation.write_report(cfg, jobs, tmp_path / cfg.name, "cmd")
  assert exit_info.value.code == 1
  out, err = capsys.readouterr()
  assert err.count("\n") == 1 and "No space left on device" in err, err
  assert f"{cfg.name}.png" in err
  assert sorted(line.split(":")[0] for line in out.splitlines()) == sorted(
      {j.run for j in jobs})


def test_a_conversion_config_is_refused_by_the_ablation_runner():
  """configs/table4.py's converted runs need the source's weights, which only
  experiments.convert puts in place: the runner refuses it in one line."""
  proc = subprocess.run([sys.executable, "-m", "experiments.ablation",
                         "--config=configs/table4.py:cpu", "--workdir=unused"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1 and "experiments.convert" in proc.stderr, proc.stderr
