"""What a capacity-bound sweep's rows say, in a few lines (results.md's "## Verdict").

    lines = verdict(cfg, rows, report_md, figure)    # [] unless cfg has `controls`

The experiment config names its controls:

    cfg.controls = dict(small="GLA_d16", large="GLA_d128", min_gap=0.2)

two runs of one family at a small and a large state, and the least accuracy gap (a
fraction) between them for the task to count as capacity-bound at this size. The lines
say (a) the control gap and whether it reaches min_gap; (b) for every SSE row, how it
compares with the GLA rows of the same active and of the same total state floats, and,
where rows carry a `variant` label (Fig. 9's key maps), every variant against the
"dense" row of the same width and gap; (c) where the report and figure are. The
compared number is the accuracy on the test set of the largest pair count P any row
evaluated (the rows' metric where none has by_pairs), mean ± std over seeds; only
numbers in the rows are used, and what is missing is said.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from experiments import report

Row = dict[str, Any]


def _stats(row: Row, pairs: str | None) -> tuple[float, float, int] | None:
  """(mean, std, seeds) of the compared number of a row, None where it has none."""
  if pairs is None:
    return report.mean_std(row["values"])
  return report.mean_std((row.get("accuracy_by_pairs") or {}).get(pairs, []))


def _text(name: str, stats: tuple[float, float, int]) -> str:
  mean, std, seeds = stats
  return f"{name} {mean:.3f} ± {std:.3f} ({seeds} seed{'s' if seeds > 1 else ''})"


def control_gap(rows: list[Row], controls, pairs: str | None) -> str:
  """(a): small vs large control at the compared number, and whether the gap reaches
  min_gap."""
  by_run = {r["run"]: r for r in rows}
  found = {}
  for role in ("small", "large"):
    name = controls.get(role)
    if name is None:
      return f"- Control gap: controls has no `{role}` run name."
    if name not in by_run:
      return f"- Control gap: the {role} control {name!r} has no row (not trained yet?)."
    found[role] = _stats(by_run[name], pairs)
    if found[role] is None:
      return f"- Control gap: the {role} control {name!r} has no value at P={pairs}."
  gap = found["large"][0] - found["small"][0]
  min_gap = float(controls.get("min_gap", 0.0))
  return (f"- Control gap: small {_text(controls['small'], found['small'])} vs large"
          f" {_text(controls['large'], found['large'])}: gap {gap:+.3f}, min_gap"
          f" {min_gap:.3f} -> capacity-bound: {'yes' if gap >= min_gap else 'no'}.")


def _against(sse: Row, s_stats, gla_rows: list[Row], key: str, pairs: str | None
             ) -> list[str]:
  """The lines comparing one SSE row with the GLA rows of the same `key` state floats."""
  what = key.rpartition("_")[2]  # "active" / "total"
  state = sse.get(key)
  if state is None:
    return [f"  - equal {what} state: the SSE row's {what} state floats are unknown."]
  same = [g for g in gla_rows if g.get(key) == state]
  if not same:
    return [f"  - equal {what} state: no GLA row with {state:,} state floats."]
  lines = []
  for g in same:
    g_stats = _stats(g, pairs)
    if g_stats is None:
      lines.append(f"  - equal {what} state ({state:,}): GLA {g['run']} has no value.")
      continue
    lines.append(f"  - equal {what} state ({state:,}): {_text('GLA ' + g['run'], g_stats)};"
                 f" SSE - GLA {_difference(s_stats, g_stats)}.")
  return lines


def _difference(a: tuple[float, float, int], b: tuple[float, float, int]) -> str:
  """a - b, and whether it exceeds the larger of the two seed stds."""
  diff, spread = a[0] - b[0], max(a[1], b[1])
  said = "separated" if abs(diff) > spread else "within seed spread"
  note = "; one seed: no spread measured" if min(a[2], b[2]) < 2 else ""
  return f"{diff:+.3f}, larger seed std {spread:.3f} -> {said}{note}"


def variants_vs_dense(rows: list[Row], pairs: str | None) -> list[str]:
  """(b'): in sweeps whose rows carry a `variant` label (Fig. 9's key maps), every other
  variant against the "dense" row with the same other labels (width, gap, ...)."""
  rest = lambda r: sorted((k, v) for k, v in r["labels"].items() if k != "variant")
  key = lambda r: json.dumps(rest(r), default=str)  # label values may be lists
  with_variant = [r for r in rows if r["labels"].get("variant") is not None]
  dense = {key(r): r for r in with_variant if r["labels"]["variant"] == "dense"}
  lines = []
  for r in with_variant:
    variant = r["labels"]["variant"]
    base = dense.get(key(r))
    if variant == "dense" or base is None:
      continue
    where = ", ".join(f"{k}={v}" for k, v in rest(r) if k != "family")
    stats, base_stats = _stats(r, pairs), _stats(base, pairs)
    if stats is None or base_stats is None:
      lines.append(f"- {where}: {variant} or dense has no value.")
      continue
    lines.append(f"- {where}: {_text(variant, stats)} vs {_text('dense', base_stats)}:"
                 f" {variant} - dense {_difference(stats, base_stats)}.")
  return lines


def sse_vs_gla(rows: list[Row], pairs: str | None) -> list[str]:
  """(b): every SSE row against the GLA rows of equal active and equal total state."""
  family = lambda r: r["labels"].get("family")
  gla = [r for r in rows if family(r) == "gla"]
  sse = [r for r in rows if family(r) == "sse"]
  if not sse:
    return ["- SSE vs GLA: no SSE rows."]
  lines = []
  for r in sse:
    stats = _stats(r, pairs)
    if stats is None:
      lines.append(f"- SSE {r['run']}: no value" + (f" at P={pairs}." if pairs else "."))
      continue
    lines.append(f"- {_text('SSE ' + r['run'], stats)}:")
    for key in ("state_floats_active", "state_floats_total"):
      lines += _against(r, stats, gla, key, pairs)
  return lines


def verdict(cfg, rows: list[Row], report_md: pathlib.Path, figure: pathlib.Path
            ) -> list[str]:
  """The verdict lines (markdown bullets), or [] when cfg has no `controls`."""
  controls = cfg.get("controls")
  if not controls:
    return []
  pairs = report.rows_largest_pairs(rows)
  what = (f"accuracy on the test set of the largest evaluated pair count, P={pairs}"
          if pairs else f"the metric `{cfg.metric}` (no row has accuracy by pair count)")
  return ([f"Compared: {what}; mean ± std (ddof = 0) over seeds.", "",
           control_gap(rows, controls, pairs)] + sse_vs_gla(rows, pairs)
          + variants_vs_dense(rows, pairs) + [f"- Report: {report_md}; figure: {figure}."])


def append_to_report(cfg, rows: list[Row], root: pathlib.Path) -> list[str]:
  """Appends the verdict (when cfg has `controls`) to root/results.md under a
  "## Verdict" heading, as the runner and the merged reports end; returns its lines."""
  lines = verdict(cfg, rows, root / "results.md", root / f"{cfg.name}.png")
  if lines:
    with open(root / "results.md", "a") as f:
      f.write("\n".join(["", "## Verdict", "", *lines]) + "\n")
  return lines
