"""Print a short table of a run's metrics.jsonl: reward curve, mismatch, probe, seconds per phase.

    python scripts/summarize_run.py runs/smollm2_arith_cpu [more run dirs ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = [("reward/accuracy", "acc", "{:.3f}"), ("reward/mean", "reward", "{:+.3f}"),
           ("response/length_mean", "len", "{:.1f}"), ("rollout/groups_kept", "kept", "{:.0f}"),
           ("mismatch/k3_kl", "kl(eng‖trn)", "{:.2e}"), ("is/clipped_frac", "tis_clip", "{:.3f}"),
           ("probe/mean_abs_logp_diff", "probe", "{:.1e}"), ("time/generate_s", "gen_s", "{:.2f}"),
           ("time/train_s", "train_s", "{:.2f}"), ("time/publish_s", "publish_s", "{:.3f}"),
           ("engine/kv_released_bytes", "kv_freed_GiB", "{:.2f}"), ("time/release_kv_s", "rel_kv_s", "{:.3f}"), ("time/reacquire_kv_s", "acq_kv_s", "{:.3f}"),
           ("time/step_s", "step_s", "{:.2f}")]


def summarize(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lines = [f"## {run_dir}", "| step | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for row in rows:
        cells = [fmt.format(row[key] / (2**30 if key.endswith("_bytes") else 1)) if key in row else "–"
                 for key, _, fmt in COLUMNS]
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    if rows:
        n = len(rows)
        means = [fmt.format(sum(r.get(k, 0.0) for r in rows) / n) if k.startswith("time/") else "" for k, _, fmt in COLUMNS]
        lines.append("| mean | " + " | ".join(means) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
