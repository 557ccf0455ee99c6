"""A sweep's figure: the experiment's panels, by name, and learning curves beside them.

    plot(cfg, rows, path)       # cfg.figure names a registered figure; rows: report.collect

A figure is a function registered by name that draws its panels from the report rows:

    @register("vs_partitions")
    def vs_partitions(cfg, rows, axes): ...   # axes: its `panels` matplotlib Axes

`panels` is a count or a function of the rows. The function may return a note for the
figure title. `plot` adds one last panel, the learning curves of cfg.metric of every
run and seed, so a new figure shape is a new registered function, not an edit here.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, NamedTuple

from experiments import report

Rows = list[dict[str, Any]]


class Figure(NamedTuple):
  draw: Callable[..., str | None]   # (cfg, rows, axes) -> a title note or None
  panels: Callable[[Rows], int]     # how many axes `draw` takes


FIGURES: dict[str, Figure] = {}


def register(name: str, panels: int | Callable[[Rows], int] = 1):
  """Registers the decorated function as figure `name` (cfg.figure)."""
  count = panels if callable(panels) else (lambda rows: panels)

  def wrap(draw):
    FIGURES[name] = Figure(draw, count)
    return draw
  return wrap


def figure_of(name: str) -> Figure:
  if name not in FIGURES:
    raise ValueError(f"unknown figure {name!r}; known: {', '.join(sorted(FIGURES))}")
  return FIGURES[name]


def plot(cfg, rows: Rows, path: pathlib.Path) -> None:
  """The figure's panels, and the learning curves of every run beside them, to `path`."""
  figure = figure_of(cfg.figure)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  n = figure.panels(rows)
  fig, axes = plt.subplots(1, n + 1, figsize=(6 * (n + 1), 4.8))
  axes[0].set_ylabel(cfg.metric.replace("_", " "))
  note = figure.draw(cfg, rows, list(axes[:n]))
  for ax in axes[:n]:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  learning_curves(axes[n], cfg, rows)
  fig.suptitle(f"{cfg.name}: {cfg.description}" + (f"\n{note}" if note else ""),
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_color(i: int):
  """The colour of the i-th run in the panels that draw every run (tab20, cycled)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  colors = matplotlib.colormaps["tab20"].colors
  return colors[i % len(colors)]


def learning_curves(ax, cfg, rows: Rows) -> None:
  """cfg.metric against step for every seed of every run, one colour per run."""
  for i, r in enumerate(rows):
    for j, history in enumerate(r["curves"]):
      pts = [(h["step"], report.curve_value(h, cfg.metric)) for h in history]
      pts = [p for p in pts if p[1] is not None]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r["run"] if j == 0 else None,
              linewidth=1, color=run_color(i))
  ax.set_xlabel("step")
  ax.set_ylabel(f"{cfg.metric.replace('_', ' ')} (learning curves"
                + (", every seed)" if len(cfg.seeds) > 1 else ")"))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)


def seed_dots(ax, rows: Rows, x_of, color, shift=1.0) -> None:
  """Every seed's value of each row with several seeds, as a dot at x_of(row) * shift
  (beside the mean: the spread can be bimodal)."""
  pts = [(x_of(r) * shift, v) for r in rows if r["seeds"] > 1 for v in r["values"]]
  if pts:
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.6, color=color,
               zorder=3)


def levels(ax, rows: Rows, name_of) -> None:
  """Each row's metric as a dashed horizontal reference, named at the left edge."""
  for r in rows:
    ax.axhline(r["metric"], linestyle="--", linewidth=1, color="gray")
    # x in axes coordinates: at the left edge whatever the x range.
    ax.text(0.01, r["metric"], f" {name_of(r)}", va="bottom", fontsize=8,
            transform=ax.get_yaxis_transform())


def has_pairs(rows: Rows) -> bool:
  return any(r.get("accuracy_by_pairs") for r in rows)


def accuracy_vs_pairs(ax, rows: Rows) -> None:
  """Accuracy on the test set of each evaluated pair count P, one line per run (mean over
  seeds, std error bars; run colours as in the learning curves)."""
  for i, r in enumerate(rows):
    stats = [(int(p), report.mean_std(v)) for p, v in (r.get("accuracy_by_pairs") or {}).items()]
    stats = sorted((p, m) for p, m in stats if m is not None)
    if stats:
      ax.errorbar([p for p, _ in stats], [m[0] for _, m in stats], [m[1] for _, m in stats],
                  fmt="o-", markersize=4, capsize=2, linewidth=1, label=r["run"],
                  color=run_color(i))
  if not has_pairs(rows):
    ax.text(0.5, 0.5, "no accuracy by pair count\n(the runs have no eval_pairs)",
            ha="center", va="center", transform=ax.transAxes)
  ax.set_xscale("log", base=2)
  pairs = sorted({int(p) for r in rows for p in r.get("accuracy_by_pairs") or {}})
  if pairs:  # the evaluated P as plain numbers, not powers of 2
    ax.set_xticks(pairs, [str(p) for p in pairs])
    ax.minorticks_off()
  ax.set_xlabel("pair count P (held-out test sets)")
  ax.set_ylabel("accuracy")


@register("vs_partitions")
def vs_partitions(cfg, rows: Rows, axes) -> None:
  """Fig. 7 (labels N, ratio 0.25 / 0.5 / "all", baseline): the metric against N, one
  line per k/N (the "all" run is the start of both), baselines as levels."""
  del cfg
  (ax,) = axes
  start = [r for r in rows if r["labels"].get("ratio") == "all"]
  for ratio, style in ((0.25, "o-"), (0.5, "s-")):
    pts = sorted([(r["labels"]["N"], r["metric"], r["metric_std"]) for r in rows
                  if r["labels"].get("ratio") == ratio]
                 + [(r["labels"]["N"], r["metric"], r["metric_std"]) for r in start])
    if pts:
      line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts],
                         fmt=style, capsize=3, label=f"k/N = {ratio:.0%}")
      own = (ratio, "all") if ratio == 0.25 else (ratio,)  # the shared start once
      seed_dots(ax, [r for r in rows if r["labels"].get("ratio") in own],
                lambda r: r["labels"]["N"], line[0].get_color(),
                shift=0.94 if ratio == 0.25 else 1.06)
      late = [(r["labels"]["N"], r["metric"]) for r in rows if not r["finished"]
              and r["labels"].get("ratio") in (ratio, "all")]
      if late:  # unfinished runs: hollow markers
        ax.plot([p[0] for p in late], [p[1] for p in late], style[0], markersize=9,
                markerfacecolor="white", color=line[0].get_color(), zorder=3)
  levels(ax, [r for r in rows if "baseline" in r["labels"]],
         lambda r: r["labels"]["baseline"])
  ax.set_xscale("log", base=2)
  ax.set_xlabel("number of partitions N")


VARIANT_MARKERS = {"dense": "o", "dense-softmax": "^", "top-k": "s"}


@register("vs_width")
def vs_width(cfg, rows: Rows, axes) -> None:
  """Fig. 9 (labels width, variant, gap): the metric against model width, one line per
  variant present ("dense", "dense-softmax", "top-k", then any other) and gap kind
  (none dotted, zero solid, noise dashed)."""
  del cfg
  (ax,) = axes
  present = {r["labels"].get("variant") for r in rows} - {None}
  variants = [v for v in VARIANT_MARKERS if v in present] + sorted(present - set(VARIANT_MARKERS))
  for gap, style in (("none", ":"), ("zero", "-"), ("noise", "--")):
    for variant in variants:
      marker = VARIANT_MARKERS.get(variant, "D")
      mine = sorted((r for r in rows if r["labels"].get("gap") == gap
                     and r["labels"].get("variant") == variant),
                    key=lambda r: r["labels"]["width"])
      if mine:
        line = ax.errorbar([r["labels"]["width"] for r in mine], [r["metric"] for r in mine],
                           [r["metric_std"] for r in mine], fmt=style, marker=marker,
                           capsize=3, label=f"{variant}, {gap} gap")
        seed_dots(ax, mine, lambda r: r["labels"]["width"], line[0].get_color())
  ax.set_xscale("log", base=2)
  ax.set_xlabel("model width")


@register("bars", panels=lambda rows: 2 if has_pairs(rows) else 1)
def bars(cfg, rows: Rows, axes) -> None:
  """Tables 6-8: one bar per run (label variant, else the run name); white bars are
  unfinished runs. With accuracy by pair count, a second panel: accuracy vs P."""
  ax = axes[0]
  if len(axes) > 1:
    accuracy_vs_pairs(axes[1], rows)
  names = [r["labels"].get("variant", r["run"]) for r in rows]
  ax.bar(range(len(rows)), [r["metric"] for r in rows],
         yerr=[r["metric_std"] for r in rows], capsize=3,
         color=["tab:blue" if r["finished"] else "white" for r in rows],
         edgecolor="tab:blue")
  position = {id(r): i for i, r in enumerate(rows)}
  seed_dots(ax, rows, lambda r: position[id(r)], "black")
  names = [n if r["finished"] else f"{n}\n(unfinished, step {r['step']})"
           for n, r in zip(names, rows)]
  ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
  paper = {k: v for k, v in dict(cfg.paper).items() if isinstance(v, (int, float))}
  if paper:
    ax.set_title("paper (real-retrieval avg.): "
                 + ", ".join(f"{k} {v}" for k, v in paper.items()), fontsize=7)


def _line(ax, rows: Rows, x_key: str, color, label: str, hollow: bool = False) -> None:
  """The rows' metric (mean, std error bars, every seed as a dot) against row[x_key]:
  solid with filled markers, or dotted with hollow ones."""
  mine = sorted(rows, key=lambda r: r[x_key])
  ax.errorbar([r[x_key] for r in mine], [r["metric"] for r in mine],
              [r["metric_std"] for r in mine], fmt="o:" if hollow else "o-", capsize=3,
              color=color, markerfacecolor="white" if hollow else color, label=label)
  seed_dots(ax, mine, lambda r: r[x_key], color)


@register("capacity", panels=2)
def capacity(cfg, rows: Rows, axes) -> str | None:
  """Capacity-bound MQAR (labels family, and line -- a name or a list of names -- for SSE
  variants): panel 1, the metric
  (accuracy at the largest evaluated P) against recurrent state floats per layer: GLA
  controls as one line; each SSE `line` at its active state (filled, solid) and, in the
  same colour, at its total state (hollow, dotted); the Transformer as a dashed level.
  Panel 2: accuracy vs pair count P, one line per run."""
  ax, ax_pairs = axes
  family = lambda r: r["labels"].get("family")
  sized = [r for r in rows if r.get("state_floats_active") is not None]
  gla = [r for r in sized if family(r) == "gla"]
  if gla:
    _line(ax, gla, "state_floats_active", "black", "GLA")
  groups: dict[str, Rows] = {}
  for r in sized:
    if family(r) not in ("gla", "transformer"):
      # `line`: one name or a list (N = 1, k = 1 starts every line); a row without
      # one (e.g. merged from an older report) goes by its family or name
      names = r["labels"].get("line", family(r) or r["run"])
      for name in names if isinstance(names, (list, tuple)) else [names]:
        groups.setdefault(str(name), []).append(r)
  for i, (name, mine) in enumerate(groups.items()):
    color = f"C{i}"
    if all(r["state_floats_total"] == r["state_floats_active"] for r in mine):
      _line(ax, mine, "state_floats_active", color, name)  # all its state is active
      continue
    _line(ax, mine, "state_floats_active", color, f"{name} (active state)")
    _line(ax, mine, "state_floats_total", color, f"{name} (total state)", hollow=True)
  late = [r for r in sized if not r["finished"] and family(r) != "transformer"]
  if late:  # unfinished: their value is their last evaluation
    ax.plot([r["state_floats_active"] for r in late], [r["metric"] for r in late], "x",
            color="red", markersize=9, zorder=4, label="unfinished (last eval)")
  levels(ax, [r for r in rows if family(r) == "transformer"], lambda r: r["run"])
  ax.set_xscale("log", base=2)
  ax.set_xlabel("recurrent state floats per layer")
  accuracy_vs_pairs(ax_pairs, rows)
  largest = report.rows_largest_pairs(rows)
  if largest is None:
    return None
  if cfg.metric == report.MAX_PAIRS_ACCURACY:
    return f"{cfg.metric}: accuracy on the held-out test set of the largest P = {largest}"
  return f"largest evaluated pair count P = {largest} (panel 2)"
