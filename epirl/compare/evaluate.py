"""Score one finished run's adapter on the study's held-out problems (its own process: one engine per adapter).

    python -m epirl.compare.evaluate RUN_DIR --problems heldout.jsonl --engine run --out RUN_DIR/heldout

Why not `epirl eval`: its local benchmark files are math benchmarks (the \\boxed{} instruction appended, graded by
the last box), and its `arithmetic` benchmark is the training list itself. The held-out arithmetic problems need
the training task's prompt as is and its own grading (`reward.style` of the run), so this builds that benchmark
and hands it to the same runner `epirl eval` uses (epirl.eval.runner.run_eval): greedy, one sample per problem,
the run's context length and token limit. Writes eval.json and records.jsonl (one verdict per problem) and,
last, meta.json: what the records were made from, so an interrupted evaluation is redone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from epirl.compare.spec import EVAL_ENGINES
from epirl.config import FP8_ENGINE_PRECISIONS, EpirlConfig, load_config, resolve_runtime
from epirl.console import quiet_library_environment
from epirl.cpu_threads import apply_thread_plan, plan_threads

HELDOUT_BENCHMARK = "heldout"


def engine_config(run_config: EpirlConfig, precision: str) -> EpirlConfig:
    """The run's config with the engine precision to evaluate under (`run`: the one it trained with)."""
    tree = run_config.model_dump(mode="json")
    if precision != "run":
        tree["engine"]["precision"] = precision
    engine = tree["engine"]["precision"]
    if tree["trainer"]["base"] == "shared" and engine not in FP8_ENGINE_PRECISIONS:
        tree["trainer"]["base"] = "bf16"  # no trainer here; the check that shared needs FP8 weights does not apply
    if tree["engine"]["serving_kernels"] in ("fused", "timed") and engine != "w8a8":
        tree["engine"]["serving_kernels"] = "auto"
    return EpirlConfig.model_validate(tree)


def heldout_benchmark(problems_file: Path, run_config: EpirlConfig):
    """The held-out problems as an eval benchmark: prompt text verbatim, graded by the run's reward style."""
    # deferred: the graders' math_verify and scipy load only when a study evaluates
    from epirl.eval.benchmarks import Benchmark, EvalProblem

    rows = [json.loads(line) for line in problems_file.read_text().splitlines() if line.strip()]
    problems = [EvalProblem(str(row["id"]), row["problem"], (str(row["answer"]),), HELDOUT_BENCHMARK) for row in rows]
    return Benchmark(HELDOUT_BENCHMARK, str(problems_file), problems, len(problems), len(problems), instruction="",
                     grading_style=run_config.reward.style, system_prompt=run_config.data.system_prompt)


def evaluate_run(run_dir: Path, problems_file: Path, precision: str, out_dir: Path) -> dict:
    """Start the engine, grade every held-out problem once (greedy), write the records; returns the report."""
    # deferred: transformers (the engine) and math_verify (the graders), for the evaluation process only
    from epirl.engine import RolloutEngine
    from epirl.eval.runner import EvalSettings, Variant, run_eval
    from epirl.rewards import RewardPool

    run_config = load_config(run_dir / "config.yaml")
    cfg = engine_config(run_config, precision)
    if resolve_runtime(cfg).type == "cpu":  # threads are decided before vLLM starts (epirl.cpu_threads)
        apply_thread_plan(plan_threads())
    benchmark = heldout_benchmark(problems_file, run_config)
    settings = EvalSettings(samples=1, temperature=0.0, max_tokens=run_config.rl.max_tokens,
                            thinking=run_config.model.thinking, seed=0, max_model_len=run_config.model.max_model_len)
    variant = Variant(run_dir.name, str(run_dir / "adapter"))
    # The pool first: its fork server starts before vLLM creates threads in this process (as in `epirl eval`).
    with RewardPool(workers=run_config.reward.workers, timeout_s=run_config.reward.timeout_s) as pool:
        engine = RolloutEngine(cfg)
        try:
            return run_eval(engine, pool, [benchmark], settings, [variant], out_dir)
        finally:
            engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epirl.compare.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished run folder (config.yaml, adapter/)")
    parser.add_argument("--problems", type=Path, required=True, help="held-out problems (.jsonl: id, problem, answer)")
    parser.add_argument("--engine", default="run", choices=EVAL_ENGINES, help="engine precision; run = the run's own")
    parser.add_argument("--out", type=Path, required=True, help="folder for eval.json, records.jsonl, meta.json")
    parser.add_argument("--meta", default="{}", help="JSON written to meta.json once the records are complete")
    args = parser.parse_args(argv)

    quiet_library_environment()
    (args.out / "meta.json").unlink(missing_ok=True)  # records being rewritten are not valid until meta.json is back
    report = evaluate_run(args.run_dir, args.problems, args.engine, args.out)
    (args.out / "meta.json").write_text(args.meta + "\n")
    accuracy = report["variants"][args.run_dir.name]["pooled"]["accuracy"]
    print(f"held-out accuracy {accuracy:.4f} ({args.run_dir.name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
