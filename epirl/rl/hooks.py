"""Measurements that run inside `epirl train` every N steps: benchmark eval and the mismatch decomposition.

Both use the live engine (with the adapter just published) so that what is measured is what serves.
"""

from __future__ import annotations

import logging
from pathlib import Path

from epirl.config import EpirlConfig
from epirl.eval.benchmarks import TrainingTask, load_benchmark, parse_benchmark_list
from epirl.eval.report import POOLED
from epirl.eval.runner import EvalSettings, Variant, run_eval
from epirl.mismatch.measure import measure_during_training

log = logging.getLogger(__name__)


class PeriodicEval:
    """`rl.eval_every` > 0: evaluate the live adapter on `rl.eval_benchmarks` (first `rl.eval_limit` each)."""

    def __init__(self, cfg: EpirlConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.training = TrainingTask.from_config(cfg)  # `arithmetic` is this run's own task, graded as it is trained
        self.benchmarks = None
        if cfg.rl.eval_every and cfg.rl.eval_benchmarks:
            specs = parse_benchmark_list(",".join(cfg.rl.eval_benchmarks))
            self.benchmarks = [load_benchmark(name, source, cfg.rl.eval_limit, self.training) for name, source in specs]

    def due(self, step: int) -> bool:
        return self.benchmarks is not None and step % self.cfg.rl.eval_every == 0

    def __call__(self, step: int, engine, pool) -> dict[str, float]:
        cfg = self.cfg
        settings = EvalSettings(samples=1, temperature=0.0, max_tokens=cfg.rl.max_tokens, thinking=cfg.model.thinking,
                                seed=cfg.seed, max_model_len=cfg.model.max_model_len)
        label = f"step_{step}"
        variant = Variant(label, use_adapter=True, training=self.training)
        report = run_eval(engine, pool, self.benchmarks, settings, [variant], out_dir=self.run_dir / "eval" / label,
                          wandb_step=step)
        summary = report["variants"][label]
        metrics = {f"eval/{name}/accuracy": m["accuracy"] for name, m in summary["benchmarks"].items()}
        metrics[f"eval/{POOLED}/accuracy"] = summary[POOLED]["accuracy"]
        return metrics


def periodic_mismatch(step: int, cfg: EpirlConfig, engine, policy, prompt_ids: list[list[int]], device) -> dict[str, float]:
    """`rl.mismatch_every` > 0: δW/δA/δK of the live engine against the live trainer on this step's prompts."""
    if not cfg.rl.mismatch_every or step % cfg.rl.mismatch_every:
        return {}
    return measure_during_training(engine, policy, cfg, prompt_ids, device)
