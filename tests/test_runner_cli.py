"""The ablation runner's command line: every mistake is one line on stderr naming the
flag, with exit status 2 and no traceback, before anything trains; flags a sweep would
drop are refused; data flags reach the evaluation stream; the recorded command can be
pasted into a shell."""

import json
import pathlib
import shlex
import subprocess
import sys

from absl.testing import flagsaver
import pytest

from configs import fig7
from configs import table8
from experiments import ablation
from experiments import sweep


def _cli(*args, timeout=120):
  """Runs the runner; returns (exit status, the non-blank lines of stderr)."""
  proc = subprocess.run([sys.executable, "-m", "experiments.ablation", *args],
                        capture_output=True, text=True, timeout=timeout)
  return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


def _under_a_file(tmp_path):
  (tmp_path / "file").write_text("")
  return str(tmp_path / "file" / "workdir")


# (arguments, words the one line must hold: the flag or path first, then the fix)
MISTAKES = {
    "config argument": (["--config=configs/fig7.py:typo"],
                        ["--config=configs/fig7.py:typo", "':cpu' or ':gpu'"]),
    "config file": (["--config=configs/nope.py"],
                    ["--config=configs/nope.py", "no such config file", "configs/fig7.py"]),
    "wrong path": (["--config=configs/fig7.py:cpu", "--config.model.sse.top_k=99"],
                   ["--config.model.sse.top_k=99",
                    "did you mean --config.train.model.sse.top_k?"]),
    "misspelled key": (["--config=configs/fig7.py:cpu", "--config.train.num_step=5"],
                       ["--config.train.num_step=5", "did you mean --config.train.num_steps?"]),
    "training config": (["--config=configs/train_default.py"],
                        ["--config=configs/train_default.py", "not return an experiment",
                         "python -m sse_jax.train --config=configs/train_default.py"]),
    "None field": (["--config=configs/fig7.py:cpu", "--config.train.data.num_queries=3"],
                   ["--config.train.data.num_queries=3", "train.data.num_queries is None",
                    "set it in a config file"]),
    "workdir in /proc": (["--config=configs/fig7.py:cpu", "--workdir=/proc/x"],
                         ["--workdir=/proc/x", "cannot create"]),
    "overwritten flag": (["--config=configs/fig7.py:cpu", "--config.train.model.sse.top_k=2"],
                         ["--config.train.model.sse.top_k", "6 of 6 runs",
                          "model.sse.top_k in N1_k1, N4_k1, N8_k2", "model in GLA_dk4",
                          "config file"]),
}


@pytest.mark.parametrize("mistake", list(MISTAKES) + ["workdir under a file"])
def test_a_mistake_is_one_line_and_exit_status_2(mistake, tmp_path):
  if mistake == "workdir under a file":
    workdir = _under_a_file(tmp_path)
    args, words = ["--config=configs/fig7.py:cpu", f"--workdir={workdir}"], [
        f"--workdir={workdir}", "cannot create", "Not a directory"]
  else:
    args, words = MISTAKES[mistake]
    args = args + [f"--workdir={tmp_path / 'w'}"] * ("--workdir" not in " ".join(args))
  code, lines = _cli(*args, "--report_only")
  assert code == 2 and len(lines) == 1, lines
  assert lines[0].startswith(words[0]) and all(w in lines[0] for w in words), lines[0]
  assert not (tmp_path / "w").exists()  # refused before anything was written


def test_train_fields_the_runs_set_again_are_refused():
  """Runs that set a field (or its parent) again would drop the flag: refused, naming
  them, also when only some runs do; lr and seed come from the sweep's lrs and seeds;
  a field no run sets is taken."""
  cfg, defaults = fig7.get_config("cpu"), fig7.get_config("cpu")
  with pytest.raises(sweep.app.UsageError,
                     match=r"^--config\.train\.model\.hidden: 3 of 6 runs .*\(model in "
                           r"GLA_dk4, GLA_dk8, GLA_dk32\)"):
    sweep.expand(cfg, pathlib.Path("w"), defaults, given=["model.hidden"])
  cfg.train.model.sse.top_k = 2  # found by comparing with the file's config
  with pytest.raises(sweep.app.UsageError, match="model.sse.top_k in N1_k1"):
    sweep.expand(cfg, pathlib.Path("w"), defaults)
  with pytest.raises(sweep.app.UsageError, match=r"--config\.lrs"):
    sweep.expand(cfg, pathlib.Path("w"), defaults, given=["lr"])
  cfg = fig7.get_config("cpu")
  cfg.train.num_steps = 7
  jobs = sweep.expand(cfg, pathlib.Path("w"), defaults)
  assert {j.config.num_steps for j in jobs} == {7}


def test_data_flags_reach_the_evaluation_stream(tmp_path, monkeypatch):
  """Rule: --config.train.data.<f> also sets eval_data.<f> when the config file's
  eval_data is its data on another split, unless eval_data.<f> is given too; where
  eval_data is a stream of its own, the flag is refused."""
  def jobs_of(*flags):
    argv = ["ablation", "--config=configs/table8.py:cpu", *flags]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides there
    with flagsaver.flagsaver():
      ablation.FLAGS(argv)
      return ablation.sweep_jobs(ablation.FLAGS.config, tmp_path)

  for job in jobs_of("--config.train.data.num_pairs=4"):
    assert job.config.data.num_pairs == job.config.eval_data.num_pairs == 4
    assert job.config.eval_data.split == "validation"
  for job in jobs_of("--config.train.data.num_pairs=4", "--config.train.eval_data.num_pairs=8"):
    assert (job.config.data.num_pairs, job.config.eval_data.num_pairs) == (4, 8)
  # A config whose eval_data is not derived from data: the flag alone is refused.
  cfg, defaults = table8.get_config("cpu"), table8.get_config("cpu")
  defaults.train.eval_data.seq_len = cfg.train.eval_data.seq_len = 48
  cfg.train.data.num_pairs = 4
  with pytest.raises(sweep.app.UsageError,
                     match=r"^--config\.train\.data\.num_pairs: .* keep eval_data\.num_pairs"
                           r"=8: give --config\.train\.eval_data\.num_pairs too"):
    sweep.expand(cfg, tmp_path, defaults, given=["data.num_pairs"])


def test_the_recorded_command_pastes_into_a_shell(tmp_path):
  """A value with spaces and parentheses survives: shlex.split of the recorded command
  gives back the arguments (less --workdir and --report_only)."""
  cfg = table8.get_config("cpu")
  cfg.seeds = (0,)
  for job in sweep.expand(cfg, tmp_path / cfg.name):  # finished runs, so no training
    job.dir.mkdir(parents=True)
    ev = {"kind": "eval", "step": 2, "loss": 1.0, "accuracy": 0.5, "router": [],
          "by_pairs": {"8": {"accuracy": 0.5, "loss": 1.0}}}
    (job.dir / "summary.json").write_text(json.dumps(
        {"step": cfg.train.num_steps, "finished": True, "eval": ev, "history": [],
         "params": 1}))
  args = ["--config=configs/table8.py:cpu", "--config.seeds=(0,)",
          "--config.description=shared vs separate (two words)"]
  proc = subprocess.run([sys.executable, "-m", "experiments.ablation", *args,
                         f"--workdir={tmp_path}", "--report_only"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  command = json.loads((tmp_path / cfg.name / "results.json").read_text())["command"]
  assert shlex.split(command) == ["python", "-m", "experiments.ablation", *args]
