"""The ablation report's capacity-bound additions, on fake run directories (no training):
accuracy by pair count, state floats per layer, model family, the max_pairs_accuracy
metric, the verdict, and every registered figure."""

import json

from absl.testing import flagsaver
import matplotlib
import ml_collections
import pytest

from configs import common
from experiments import ablation
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import verdict
from sse_jax.model import ModelConfig
from sse_jax.train import logs

matplotlib.use("Agg")

# A setting like the configs' (`configs/fig7.setting`): hidden 32, 2 heads, key dim
# None = D / H: Dk = Dv = 16, one GLA state 2*16*16 = 512.
S = ml_collections.ConfigDict(dict(
    variant="cpu", hidden=32, num_heads=2, layers=2, key_dim=None, vocab_size=64,
    seq_len=32, min_pairs=1, max_pairs=4, eval_pairs=(4, 8), batch_size=16,
    num_steps=100, warmup_steps=10, eval_every=50, lrs=(3e-3,), seeds=(0,),
    chunk_size=16, sse_impl="varlen", gla_impl="chunk", compute_dtype="float32",
    data_workers=0, workers=1))
LRS = (1e-3, 3e-3)      # the fake runs make 3e-3 the lower-loss (chosen) lr

# run -> (per-seed accuracy at P=4, at P=8) at the chosen lr
ACCURACY = {"GLA_d32": ([0.90, 0.92], [0.30, 0.34]),
            "GLA_h6": ([0.95, 0.97], [0.60, 0.64]),
            "N8_k2": ([0.96, 0.98], [0.61, 0.65]),
            "Transformer": ([1.0, 1.0], [0.99, 0.99]),
            "GA": ([0.9, 0.9], [0.5, 0.5]),
            "kept": ([0.9, 0.9], [0.5, 0.5])}


def _gla(hidden, heads):
  model = common.model(S, "GG", hidden=hidden)
  model["num_heads"] = heads
  return model


def _config(controls=None):
  base = common.train(S, common.model(S))
  base.eval_pairs = (4, 8)
  runs = [common.run("GLA_d32", {}, model=_gla(32, 2)),
          # 6 heads of 16 x 16: 1536 floats, the SSE run's active state
          common.run("GLA_h6", {}, model=_gla(96, 6)),
          common.run("N8_k2", dict(line="k/N=25%"),
                     **{"model.sse.num_partitions": 8, "model.sse.top_k": 2}),
          common.run("Transformer", {}, model=common.model(S, "AA")),
          common.run("GA", {}, model=common.model(S, "GA")),
          common.run("kept", dict(family="custom"))]
  cfg = common.experiment("cap", S, base, runs, figure="capacity",
                          metric="max_pairs_accuracy", description="capacity test")
  cfg.lrs, cfg.seeds = LRS, (0, 1)
  if controls is not None:
    cfg.controls = controls
  return cfg


def _eval_record(step, loss, acc4, acc8, sse_layers):
  by_pairs = {"4": dict(accuracy=acc4, loss=loss, answers=1024.0, agreement=[None]),
              "8": dict(accuracy=acc8, loss=loss, answers=1024.0, agreement=[None])}
  router = [dict(layer=i, usage=[0.25] * 8, entropy=1.0, max=0.25, agreement=0.5 + 0.1 * i
                 + step / 1000) for i in range(sse_layers)]
  return dict(kind="eval", step=step, train_loss=loss, loss=loss, accuracy=acc8,
              by_pairs=by_pairs, router=router)


def _write_runs(cfg, root):
  """summary.json of every job: two evals; the chosen lr (3e-3) has the lower loss and
  the accuracies of ACCURACY, the other lr accuracy 0."""
  jobs = sweep.expand(cfg, root)
  for job in jobs:
    acc4, acc8 = ACCURACY[job.run]
    i = list(cfg.seeds).index(job.seed)
    chosen = job.lr == LRS[1]
    layers = 2 if job.run in ("N8_k2", "kept") else 0
    records = [_eval_record(50, 3.0, 0.1, 0.1, layers),
               _eval_record(100, 1.0 if chosen else 2.0, acc4[i] if chosen else 0.0,
                            acc8[i] if chosen else 0.0, layers)]
    job.dir.mkdir(parents=True)
    summary = dict(step=100, finished=True, eval=records[-1], history=logs.history(records),
                   params=1, tokens_per_s=1.0, wall_time_s=1.0)
    (job.dir / "summary.json").write_text(json.dumps(summary))
  return jobs


@pytest.fixture(name="rows")
def _rows(tmp_path):
  cfg = _config()
  return report.collect(cfg, _write_runs(cfg, tmp_path))


def _by_run(rows):
  return {r["run"]: r for r in rows}


def test_accuracy_by_pairs_per_seed_at_the_chosen_lr(rows):
  row = _by_run(rows)["N8_k2"]
  assert row["lr"] == LRS[1]
  assert row["accuracy_by_pairs"] == {"4": [0.96, 0.98], "8": [0.61, 0.65]}
  # max_pairs_accuracy: the accuracy at the largest P, per seed
  assert row["values"] == [0.61, 0.65] and row["metric"] == pytest.approx(0.63)
  assert row["metric_std"] == pytest.approx(0.02)
  # the per-layer router agreement of the last eval, mean over seeds
  assert row["agreement"] == pytest.approx([0.6, 0.7])
  assert "agreement" not in _by_run(rows)["GLA_d32"]


def test_state_floats_and_family_of_each_model(rows):
  got = {r["run"]: (r["state_floats_active"], r["state_floats_total"], r["labels"]["family"])
         for r in rows}
  assert got["GLA_d32"] == (512, 512, "gla")
  assert got["GLA_h6"] == (6 * 16 * 16, 6 * 16 * 16, "gla")
  # SSE, N = 8, k = 2, shared partition: (k + 1) and (N + 1) states of 2 x 16 x 16
  assert got["N8_k2"] == (512 * 3, 512 * 9, "sse")
  # attention: K and V of T = 32 tokens, 2 heads of 16
  assert got["Transformer"] == (2 * 32 * 2 * 16,) * 2 + ("transformer",)
  assert got["GA"] == (2048, 2048, "hybrid")  # the larger layer
  assert got["kept"][2] == "custom"  # a config-given family stays


def test_state_floats_of_sse_variants():
  def floats(**sse):
    fields = dict(common.sse_mixer(S), num_partitions=8, top_k=2, **sse)
    model = ModelConfig.create(pattern="S", vocab_size=64, hidden=32, num_heads=2,
                               mlp_dim=64, sse=fields)
    out = report.state_floats(model, 32)
    return out["state_floats_active"], out["state_floats_total"]
  assert floats() == (1536, 4608)
  assert floats(share_partition_params=False) == (1536, 4608)
  assert floats(shared_partition=False) == (1024, 4096)
  assert floats(num_writers=3) == (2048, 4608)
  assert report.family_of("SSSA") == "hybrid" and report.family_of("GG") == "gla"


def test_max_pairs_accuracy_metric_and_curves(rows):
  summary = {"eval": {"accuracy": 0.5, "by_pairs": {"16": {"accuracy": 0.2},
                                                    "4": {"accuracy": 0.9}}}}
  assert report.metric(summary, "max_pairs_accuracy") == 0.2  # 16 > 4 as numbers
  assert report.metric(summary, "eval_accuracy") == 0.5
  with pytest.raises(ValueError, match="eval_pairs"):
    report.metric({"eval": {"accuracy": 0.5}}, "max_pairs_accuracy")
  curve = _by_run(rows)["N8_k2"]["curves"][0]
  assert [report.curve_value(h, "max_pairs_accuracy") for h in curve] == [0.1, 0.61]
  assert report.curve_value({"step": 1}, "max_pairs_accuracy") is None


def test_tables_have_the_new_fields(rows, tmp_path):
  cfg = _config()
  report.write_tables(cfg, rows, tmp_path, "cmd")
  saved = _by_run(json.loads((tmp_path / "results.json").read_text())["rows"])["N8_k2"]
  assert saved["accuracy_by_pairs"] == {"4": [0.96, 0.98], "8": [0.61, 0.65]}
  assert (saved["state_floats_active"], saved["state_floats_total"]) == (1536, 4608)
  md = (tmp_path / "results.md").read_text()
  assert "| run | P=4 | P=8 |" in md
  assert "| N8_k2 | 0.9700 ± 0.0100 | 0.6300 ± 0.0200 |" in md
  assert "| 1,536 / 4,608 | 0.600 / 0.700 |" in md
  csv_text = (tmp_path / "results.csv").read_text()
  assert "P4 0.970 P8 0.630" in csv_text


def test_verdict_lines(rows, tmp_path):
  md, png = tmp_path / "results.md", tmp_path / "cap.png"
  assert verdict.verdict(_config(), rows, md, png) == []  # no controls: no verdict
  cfg = _config(dict(small="GLA_d32", large="GLA_h6", min_gap=0.2))
  text = "\n".join(verdict.verdict(cfg, rows, md, png))
  assert "largest evaluated pair count, P=8" in text
  assert "gap +0.300" in text and "capacity-bound: yes" in text
  # equal active state: GLA_h6 (0.62 ± 0.02) vs SSE (0.63 ± 0.02)
  assert ("equal active state (1,536): GLA GLA_h6 0.620 ± 0.020 (2 seeds); SSE - GLA"
          " +0.010, larger seed std 0.020 -> within seed spread.") in text
  assert "equal total state: no GLA row with 4,608 state floats." in text
  assert f"- Report: {md}; figure: {png}." in text
  cfg.controls.min_gap = 0.5
  assert "capacity-bound: no" in "\n".join(verdict.verdict(cfg, rows, md, png))
  apart = [dict(r, accuracy_by_pairs={"8": [0.9, 0.92]}) if r["run"] == "N8_k2" else r
           for r in rows]
  assert "-> separated." in "\n".join(verdict.verdict(cfg, apart, md, png))
  cfg.controls.small = "GLA_d8"
  assert "the small control 'GLA_d8' has no row" in "\n".join(
      verdict.verdict(cfg, rows, md, png))


def test_the_report_appends_the_verdict(tmp_path):
  cfg = _config(dict(small="GLA_d32", large="GLA_h6", min_gap=0.2))
  jobs = _write_runs(cfg, tmp_path)
  with flagsaver.flagsaver():
    ablation.FLAGS(["ablation", "--config=configs/table8.py:cpu"])  # --results unset
    ablation.write_report(cfg, jobs, tmp_path, "cmd")
  md = (tmp_path / "results.md").read_text()
  assert "\n## Verdict\n" in md and "capacity-bound: yes" in md
  assert (tmp_path / "cap_cpu.png").stat().st_size > 0


@pytest.mark.parametrize("figure", sorted(plots.FIGURES))
def test_every_registered_figure_draws(figure, rows, tmp_path):
  cfg = _config()
  cfg.figure = figure
  plots.plot(cfg, rows, tmp_path / "fig.png")
  assert (tmp_path / "fig.png").stat().st_size > 0


def test_vs_width_draws_each_variant_and_unknown_figures_are_refused(rows):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  variants = ("dense", "dense-softmax", "top-k")
  fake = [dict(r, labels=dict(width=16 * (i + 1), variant=v, gap="noise"))
          for i, (r, v) in enumerate(zip(rows, variants * 2))]
  fig, ax = plt.subplots()
  plots.vs_width(None, fake, [ax])
  labels = ax.get_legend_handles_labels()[1]
  plt.close(fig)
  assert labels == [f"{v}, noise gap" for v in variants]
  cfg = _config()
  cfg.figure = "vs_nothing"
  with pytest.raises(ValueError, match="unknown figure 'vs_nothing'; known: bars, capacity"):
    plots.plot(cfg, rows, "unused.png")


def test_verdict_compares_each_key_map_with_dense_keys_of_the_same_width_and_gap():
  def row(run, variant, width, gap, values):
    return dict(run=run, labels=dict(family="gla", variant=variant, width=width, gap=gap),
                values=values, accuracy_by_pairs={"16": values})
  rows = [row("none_dense_d64", "dense", 64, "none", [0.1, 0.2]),
          row("none_dense_d512", "dense", 512, "none", [0.8, 0.7]),
          row("noise_dense_d512", "dense", 512, "noise", [0.82, 0.01]),
          row("noise_top-k_d512", "top-k", 512, "noise", [0.57, 0.98]),
          row("zero_top-k_d512", "top-k", 512, "zero", [0.3, 0.4]),   # no dense row
          row("noise_top-k_d64", "top-k", 64, "noise", [0.9, 0.92]),  # no dense row
          dict(run="N4_k1", labels=dict(family="sse", line=["k=1"]), values=[0.3, 0.4],
               accuracy_by_pairs={"16": [0.3, 0.4]})]  # no variant; a list label
  lines = verdict.variants_vs_dense(rows, "16")
  assert lines == ["- gap=noise, width=512: top-k 0.775 ± 0.205 (2 seeds) vs dense 0.415 ± "
                   "0.405 (2 seeds): top-k - dense +0.360, larger seed std 0.405 -> within "
                   "seed spread."]
  rows[2] = row("noise_dense_d512", "dense", 512, "noise", [0.02, 0.01])
  assert verdict.variants_vs_dense(rows, "16")[0].endswith("-> separated.")
  assert verdict.variants_vs_dense([r for r in rows if r["labels"].get("variant") == "dense"],
                                   "16") == []
