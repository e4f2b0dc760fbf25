"""`epirl eval`: benchmark loaders (OlympiadBench, Minerva, MATH-500), the runner, statistics, the report."""

from epirl.eval.benchmarks import BENCHMARKS, Benchmark, EvalProblem, load_benchmark, parse_benchmark_list
from epirl.eval.runner import EvalSettings, Variant, evaluate_variant, run_eval
from epirl.eval.stats import (
    bootstrap_interval,
    mcnemar_exact_p,
    paired_comparison,
    pass_at_k,
    summarize_correctness,
    wilson_interval,
)

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "EvalProblem",
    "EvalSettings",
    "Variant",
    "bootstrap_interval",
    "evaluate_variant",
    "load_benchmark",
    "mcnemar_exact_p",
    "paired_comparison",
    "parse_benchmark_list",
    "pass_at_k",
    "run_eval",
    "summarize_correctness",
    "wilson_interval",
]
