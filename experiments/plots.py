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
  learning_curves(axes[n], cfg, rows, plt.cm.tab20.colors)
  fig.suptitle(f"{cfg.name}: {cfg.description}" + (f"\n{note}" if note else ""),
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def learning_curves(ax, cfg, rows: Rows, colors) -> None:
  """cfg.metric against step for every seed of every run, one colour per run."""
  for i, r in enumerate(rows):
    for j, history in enumerate(r["curves"]):
      steps = [h["step"] for h in history if cfg.metric in h]
      ax.plot(steps, [h[cfg.metric] for h in history if cfg.metric in h],
              label=r["run"] if j == 0 else None, linewidth=1,
              color=colors[i % len(colors)])
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
  for r in rows:
    if "baseline" in r["labels"]:
      ax.axhline(r["metric"], linestyle="--", linewidth=1, color="gray")
      # x in axes coordinates: at the left edge whichever N the sweep has.
      ax.text(0.01, r["metric"], f" {r['labels']['baseline']}", va="bottom", fontsize=8,
              transform=ax.get_yaxis_transform())
  ax.set_xscale("log", base=2)
  ax.set_xlabel("number of partitions N")


@register("vs_width")
def vs_width(cfg, rows: Rows, axes) -> None:
  """Fig. 9 (labels width, variant, gap): the metric against model width, one line per
  variant and gap kind."""
  del cfg
  (ax,) = axes
  for gap, style in (("zero", "-"), ("noise", "--")):
    for variant, marker in (("dense", "o"), ("top-k", "s")):
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


@register("bars")
def bars(cfg, rows: Rows, axes) -> None:
  """Tables 6-8: one bar per run (label variant, else the run name); white bars are
  unfinished runs."""
  (ax,) = axes
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
