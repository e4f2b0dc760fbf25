"""The mismatch report: rich tables on the terminal, `mismatch.json`, `mismatch.png`, W&B."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from rich.table import Table

from epirl.mismatch.variants import VARIANTS

log = logging.getLogger(__name__)

DECOMPOSITION_PARTS = ("delta_W", "delta_A", "delta_K")


def _fmt(stat: dict | None, digits: int = 3, suffix: str = "") -> str:
    if stat is None:
        return "n/a"
    mean, (lo, hi) = stat["mean"], stat["ci95"]
    if any(map(math.isnan, (mean, lo, hi))):
        return "nan"
    return f"{mean:.{digits}g}{suffix} [{lo:.{digits}g}, {hi:.{digits}g}]"


def render_tables(summary: dict, console) -> None:
    """One table of engine × trainer variant metrics, one of the δW/δA/δK decomposition, then the notes."""
    table = Table(title="engine vs trainer variant (mean [95% CI over prompts])")
    for column in ("engine", "trainer", "mean |Δ log p|", "× bf16 pair", "KL top-k+tail", "× bf16 pair",
                   "TIS clip (cap 2)"):
        table.add_column(column, overflow="fold")
    for precision, engine in summary["engines"].items():
        for v, entry in engine["vs"].items():
            marker = " *" if v == engine["matched_variant"] else ""
            table.add_row(precision, f"({v}) {VARIANTS[v]}{marker}", _fmt(entry["abs_dlogp"]),
                          _fmt(entry.get("rel_abs_dlogp"), suffix="×"), _fmt(entry["kl"]),
                          _fmt(entry.get("rel_kl"), suffix="×"), _fmt(entry["tis_clip_frac"]))
    console.print(table)
    decomposition = Table(title="log p_eng − log p_a = δW + δA + δK (mean |·| [95% CI], share of Σ mean |·|)")
    for column in ("engine", "tokens", "|total|", "δW", "δA", "δK", "identity max err", "tail mass"):
        decomposition.add_column(column, overflow="fold")
    for precision, engine in summary["engines"].items():
        parts = engine["decomposition"]
        cells = []
        for part in DECOMPOSITION_PARTS:
            share = parts[part]["share"]
            cells.append(_fmt(parts[part]["mean_abs"]) + ("" if share is None else f" ({100 * share:.0f}%)"))
        decomposition.add_row(precision, str(engine["tokens"]), _fmt(parts["total"]["mean_abs"]), *cells,
                              f"{engine['identity_max_abs_err']:.1e}", f"{engine['engine_tail_mass_mean']:.1e}")
    console.print(decomposition)
    console.print("* = the engine's matched trainer variant (where its chain a → b → c stops)")
    check = summary.get("checks", {}).get("fake_quant")
    if check:
        console.print(f"variant (c) vs its definition on {check['module']}: rel. error "
                      f"{check['rel_err_vs_definition']:.1e} (FP8 activation rounding itself moves it by "
                      f"{check['rel_change_vs_b']:.1e})")
    for note in summary.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")


def write_json(summary: dict, out_dir: Path) -> Path:
    path = out_dir / "mismatch.json"
    path.write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    return path


def write_chart(summary: dict, out_dir: Path) -> Path:
    """Left: mean |Δ log p| per engine and trainer variant (log scale, 95% CIs). Right: δW/δA/δK shares."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    engines = list(summary["engines"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs, means, errs = [], [], [[], []]
        for j, precision in enumerate(engines):
            entry = summary["engines"][precision]["vs"].get(v)
            if entry is None:
                continue
            mean, (lo, hi) = entry["abs_dlogp"]["mean"], entry["abs_dlogp"]["ci95"]
            xs.append(j + (i - (len(VARIANTS) - 1) / 2) * width)
            means.append(max(mean, 1e-12))  # log axis: an exact 0 (identical arithmetic) sits at the floor
            errs[0].append(max(mean - lo, 0.0) if not math.isnan(lo) else 0.0)
            errs[1].append(max(hi - mean, 0.0) if not math.isnan(hi) else 0.0)
        left.bar(xs, means, width, yerr=errs, capsize=3, label=f"({v}) {VARIANTS[v]}")
    left.set_xticks(range(len(engines)), [f"{p} engine" for p in engines])
    left.set_yscale("log")
    left.set_ylabel("mean |log p_engine − log p_trainer| (nats)")
    left.legend(fontsize=8)
    bottoms = [0.0] * len(engines)
    for part in DECOMPOSITION_PARTS:
        shares = [summary["engines"][p]["decomposition"][part]["share"] or 0.0 for p in engines]
        right.bar(range(len(engines)), shares, 0.6, bottom=bottoms, label=part.replace("delta_", "δ"))
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    right.set_xticks(range(len(engines)), [f"{p} engine" for p in engines])
    right.set_ylabel("share of Σ mean |δ|")
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    fig.suptitle("engine–trainer mismatch: δW (weights), δA (activations), δK (kernels)")
    fig.tight_layout()
    path = out_dir / "mismatch.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def flat_metrics(summary: dict) -> dict[str, float]:
    """`mismatch/<engine>/<variant>/<metric>` and `mismatch/<engine>/<part>_share` for W&B summaries."""
    out: dict[str, float] = {}
    for precision, engine in summary["engines"].items():
        for v, entry in engine["vs"].items():
            for metric, stat in entry.items():
                if stat is not None:
                    out[f"mismatch/{precision}/{v}/{metric}"] = stat["mean"]
        for part, values in engine["decomposition"].items():
            out[f"mismatch/{precision}/{part}_abs"] = values["mean_abs"]["mean"]
            if values.get("share") is not None:
                out[f"mismatch/{precision}/{part}_share"] = values["share"]
    return out


def log_wandb(summary: dict, chart: Path, mode: str, project: str, run_name: str, out_dir: Path) -> None:
    """One W&B run with the flat metrics as summary, the chart as an image; failures only warn."""
    if mode == "disabled":
        return
    try:
        import wandb

        run = wandb.init(project=project, name=run_name, mode=mode, dir=str(out_dir), job_type="mismatch",
                         config={k: v for k, v in summary.get("settings", {}).items()})
        run.summary.update(flat_metrics(summary))
        run.log({"mismatch/chart": wandb.Image(str(chart))})
        run.finish()
    except Exception as exc:  # network, auth, disk: the local report is already written
        log.warning("W&B logging skipped (%s: %s); the report is in %s", type(exc).__name__, exc, out_dir)


def markdown_table(summary: dict) -> str:
    """The headline numbers as a Markdown table (BENCHMARKS.md, notes)."""
    rows = ["| engine | trainer | mean \\|Δ log p\\| | × bf16 pair | KL top-k+tail | × bf16 pair | TIS clip (cap 2) |"
            " δW / δA / δK share |",
            "|---|---|---|---|---|---|---|---|"]
    for precision, engine in summary["engines"].items():
        parts = engine["decomposition"]
        shares = " / ".join("–" if parts[p]["share"] is None else f"{100 * parts[p]['share']:.0f}%"
                            for p in DECOMPOSITION_PARTS)
        for v, entry in engine["vs"].items():
            marker = " *" if v == engine["matched_variant"] else ""
            rows.append(f"| {precision} | ({v}) {VARIANTS[v]}{marker} | {_fmt(entry['abs_dlogp'])} | "
                        f"{_fmt(entry.get('rel_abs_dlogp'), suffix='×')} | {_fmt(entry['kl'])} | "
                        f"{_fmt(entry.get('rel_kl'), suffix='×')} | {_fmt(entry['tis_clip_frac'])} | "
                        f"{shares if v == engine['matched_variant'] else ''} |")
    return "\n".join(rows)
