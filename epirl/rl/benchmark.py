"""`epirl train RECIPE --benchmark N`: the real training loop for N steps, measured.

Everything is the loop of `epirl.rl.loop` (engine with its CUDA graphs and KV release, publish every step,
the trainer as configured) except two inputs, both labelled in every output:
- prompts are synthetic token ids of a fixed length (`--prompt-tokens`, default min(256, the recipe's cap):
  DAPO-Math prompts with their instruction are ~100-300 tokens), so no dataset or tokenizer is needed;
- rewards are a seeded coin per sample (p = 1/2), so groups are informative and every phase does its
  real work (dynamic sampling keeps ~99 % of groups of 8), but nothing is learned.
Responses run to what the model samples (random weights rarely stop early) or, with `--force-max-tokens`,
always to `rl.max_tokens`. Per step: seconds per phase, tokens/s, the memory split, and the share of publish
+ KV release + re-acquire in the step; after each step the pre-flight plan is set beside what was measured
(step 1's split; the activation peak as the largest over the steps).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from epirl.config import resolve_model_path
from epirl.data import Problem, Prompt

log = logging.getLogger(__name__)

REWARD_SOURCE = "seeded coin (p=1/2 per sample): benchmark rewards, not a task"
PHASES = ("generate", "score", "train", "publish", "release_kv", "reacquire_kv", "probe")
GiB = 1024 ** 3


@dataclass
class BenchmarkSettings:
    steps: int
    prompt_tokens: int | None = None  # None: min(256, the recipe's prompt cap)
    force_max_tokens: bool = False
    out: str | None = None  # benchmark.json path (default: <run>/benchmark.json)


def prompt_length(cfg, settings: BenchmarkSettings) -> int:
    return max(1, min(settings.prompt_tokens or 256, cfg.prompt_token_limit))


SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "video_token_id",
                        "vision_start_token_id", "vision_end_token_id")


def regular_token_limit(cfg) -> int:
    """Synthetic prompts draw ids below this: the vocabulary, up to the first special token in its upper half
    (Qwen's specials — EOS, image placeholders — sit after the regular tokens; a stray image token in a
    text-only prompt is not what a real prompt holds)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    vocab = int(config.get_text_config().vocab_size)
    ids = []
    for holder in (config, config.get_text_config()):
        for name in SPECIAL_TOKEN_FIELDS:
            value = getattr(holder, name, None)
            ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    upper = [i for i in ids if vocab // 2 <= i < vocab]
    return min(upper) if upper else vocab


class SyntheticPrompts:
    """The prompt stream's interface (take / cursor / state) over seeded random token ids."""

    def __init__(self, cfg, settings: BenchmarkSettings, salt: int = 0):
        self.length, self.vocab = prompt_length(cfg, settings), regular_token_limit(cfg)
        self.seed = cfg.seed * 1_000_003 + salt
        self.cursor = 0

    def take(self, count: int) -> list[Prompt]:
        prompts = []
        for _ in range(count):
            generator = torch.Generator().manual_seed(self.seed + self.cursor)
            ids = torch.randint(0, self.vocab, (self.length,), generator=generator).tolist()
            prompts.append(Prompt(Problem(f"synthetic-{self.cursor}", [], "coin"), ids))
            self.cursor += 1
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])


def probe_prompts(cfg, settings: BenchmarkSettings) -> list[list[int]]:
    return [p.token_ids for p in SyntheticPrompts(cfg, settings, salt=1).take(cfg.engine.probe_prompts)]


class CoinRewards:
    """The reward pool's interface: each sample is 'correct' with probability 1/2 from a seeded generator."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def __enter__(self) -> "CoinRewards":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def grade_batch(self, completions: list[str], ground_truths: list[str], style: str
                    ) -> tuple[list[float], dict[str, float]]:
        coins = torch.rand(len(completions), generator=self.generator) < 0.5
        return coins.float().tolist(), {"reward/seeded_coin": 1.0}


def engine_weight_bytes(engine) -> int:
    """Bytes of the engine model's parameters and buffers (unique storages): what stays during training."""
    seen, total = set(), 0
    model = engine.vllm_model()
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def pinned_host_bytes() -> float:
    """Page-locked host memory held by torch's pinned allocator (vLLM's and the trainer's pinned buffers)."""
    if not torch.cuda.is_available():
        return 0.0
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return float(stats[key])
    return float("nan")


def optimizer_bytes(optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


class Recorder:
    """Per-step benchmark rows (returned as `benchmark/...` metrics too), then a table and benchmark.json."""

    def __init__(self, cfg, settings: BenchmarkSettings, plan: dict | None, engine, run_dir: Path):
        self.cfg, self.settings, self.plan = cfg, settings, plan or {}
        self.path = Path(settings.out) if settings.out else run_dir / "benchmark.json"
        self.engine_weights = engine_weight_bytes(engine)
        self.rows: list[dict] = []
        self.gdn_kernel = "none"
        log.info("benchmark: %d steps, %d-token synthetic prompts, rewards from a %s%s", settings.steps,
                 prompt_length(cfg, settings), REWARD_SOURCE, ", responses forced to rl.max_tokens"
                 if settings.force_max_tokens else "")

    def record(self, step: int, metrics: dict, policy, optimizer) -> dict[str, float]:
        seconds = {phase: metrics.get(f"time/{phase}_s", 0.0) for phase in PHASES}
        step_s = metrics["time/step_s"]
        report = policy.memory_report()
        self.gdn_kernel = policy.linear_attention_kernel
        row = {"step": step, **{f"{phase}_s": value for phase, value in seconds.items()}, "step_s": step_s,
               "generated_tokens": metrics.get("rollout/generated_tokens", 0.0),
               "trained_tokens": metrics.get("train/processed_tokens", 0.0),
               "response_length_mean": metrics.get("response/length_mean", 0.0),
               "engine_weight_bytes": float(self.engine_weights),
               "kv_pool_bytes": metrics.get("engine/kv_released_bytes", float("nan")),
               "trainer_base_bytes": float(report["base_weight_bytes"]),
               "trainer_lora_bytes": float(report["lora_param_bytes"] + report["lora_grad_bytes"]),
               "trainer_optimizer_bytes": float(optimizer_bytes(optimizer)),
               "trainer_activation_peak_bytes": float(report.get("peak_activation_bytes_est", float("nan"))),
               "gpu_peak_bytes": float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else float("nan"),
               "pinned_host_bytes": pinned_host_bytes(),
               # engine-trainer agreement on the trained tokens: the bitwise pairing's bar is 1.0 on every step
               "kl_k3": metrics.get("mismatch/k3_kl", float("nan")),
               "bitwise_frac": metrics.get("mismatch/bitwise_frac", float("nan"))}
        row["generated_tok_per_s"] = row["generated_tokens"] / max(seconds["generate"], 1e-9)
        row["trained_tok_per_s"] = row["trained_tokens"] / max(seconds["train"], 1e-9)
        row["publish_kv_share"] = (seconds["publish"] + seconds["release_kv"] + seconds["reacquire_kv"]) / max(step_s, 1e-9)
        self.rows.append(row)
        self._write()  # after every step: a run cut short (a device time limit) keeps what it measured
        return {f"benchmark/{k}": float(v) for k, v in row.items() if k != "step"}

    def _pairs(self) -> list[tuple[str, float, float]]:
        """(what, planned GiB, measured GiB): step 1's split, and the activation peak as the largest over the
        steps so far (step 1 reads low by the AdamW moments, which are created after its peak)."""
        first = self.rows[0]
        measured = {"engine weights": first["engine_weight_bytes"], "KV pool": first["kv_pool_bytes"],
                    "trainer base (own)": first["trainer_base_bytes"],
                    "trainer LoRA+grad+AdamW": first["trainer_lora_bytes"] + first["trainer_optimizer_bytes"],
                    "trainer activation peak": max(row["trainer_activation_peak_bytes"] for row in self.rows)}
        planned = {"engine weights": "engine_weight_bytes", "KV pool": "kv_pool_bytes",
                   "trainer base (own)": "trainer_base_bytes", "trainer LoRA+grad+AdamW": "trainer_lora_optimizer_bytes",
                   "trainer activation peak": "trainer_activation_bytes"}
        return [(what, self.plan.get(f"plan/{planned[what]}", float("nan")) / GiB, value / GiB)
                for what, value in measured.items()]

    def summary(self) -> dict:
        cfg = self.cfg
        return {"reward_source": REWARD_SOURCE, "random_weights": cfg.model.load_format == "dummy",
                "model": cfg.model.path, "engine_precision": cfg.engine.precision, "trainer_base": cfg.trainer.base,
                "correction": cfg.rl.correction, "lora_rank": cfg.lora.rank, "prompts_per_step": cfg.rl.prompts_per_step,
                "samples_per_prompt": cfg.rl.samples_per_prompt, "max_tokens": cfg.rl.max_tokens,
                "prompt_tokens": prompt_length(cfg, self.settings), "force_max_tokens": self.settings.force_max_tokens,
                "gpu_memory_utilization": cfg.engine.gpu_memory_utilization, "enforce_eager": cfg.engine.enforce_eager,
                "linear_attention_kernel": self.gdn_kernel,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "command": " ".join(sys.argv)}

    def _write(self) -> dict:
        out = {"summary": self.summary(), "plan": self.plan,
               "plan_vs_measured_gib": [{"what": w, "plan": p, "measured": m} for w, p, m in self._pairs()]
               if self.rows else [], "steps": self.rows}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(out, indent=1, default=float))
        tmp.replace(self.path)
        return out

    def finish(self) -> Path:
        print(format_table(self._write()))
        return self.path


def _fmt(value: float, scale: float = 1.0, digits: int = 2) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value / scale:.{digits}f}"


def _kl(value: float | None) -> str:
    return "nan" if value is None or math.isnan(value) else f"{value:.2e}"


def format_table(result: dict) -> str:
    s = result["summary"]
    lines = [f"benchmark: {s['model']} | engine {s['engine_precision']} | trainer.base {s['trainer_base']} | "
             f"{s['prompts_per_step']}x{s['samples_per_prompt']} <= {s['max_tokens']} tokens | rank {s['lora_rank']} | "
             f"{'RANDOM WEIGHTS | ' if s['random_weights'] else ''}rewards: {s['reward_source']} | "
             f"linear attention: {s['linear_attention_kernel']} | {s['device']}",
             "| step | gen s | score s | train s | publish s | rel KV s | acq KV s | probe s | step s | gen tok/s "
             "| train tok/s | pub+KV % | engine W GiB | KV GiB | trn base GiB | LoRA+opt GiB | act GiB | pinned GiB "
             "| KL | bitwise |",
             "|" + "---|" * 20]
    for r in result["steps"]:
        lines.append(
            f"| {r['step']} | {_fmt(r['generate_s'])} | {_fmt(r['score_s'])} | {_fmt(r['train_s'])} | "
            f"{_fmt(r['publish_s'], digits=3)} | {_fmt(r['release_kv_s'], digits=3)} | {_fmt(r['reacquire_kv_s'], digits=3)} | "
            f"{_fmt(r['probe_s'])} | {_fmt(r['step_s'])} | {_fmt(r['generated_tok_per_s'], digits=0)} | "
            f"{_fmt(r['trained_tok_per_s'], digits=0)} | {_fmt(100 * r['publish_kv_share'])} | "
            f"{_fmt(r['engine_weight_bytes'], GiB)} | {_fmt(r['kv_pool_bytes'], GiB)} | {_fmt(r['trainer_base_bytes'], GiB, 4)} | "
            f"{_fmt(r['trainer_lora_bytes'] + r['trainer_optimizer_bytes'], GiB)} | "
            f"{_fmt(r['trainer_activation_peak_bytes'], GiB)} | {_fmt(r['pinned_host_bytes'], GiB)} | "
            f"{_kl(r.get('kl_k3'))} | {_fmt(r.get('bitwise_frac'), digits=4)} |")
    if result["plan_vs_measured_gib"]:
        lines.append("pre-flight plan vs measured (GiB; activation peak: the largest over the steps): " + "; ".join(
            f"{row['what']} {_fmt(row['plan'])} / {_fmt(row['measured'])}" for row in result["plan_vs_measured_gib"]))
    return "\n".join(lines)


