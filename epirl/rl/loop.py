"""The colocated GRPO/DAPO loop on one device: read this file to see the whole algorithm.

Per step:
  1. generate      n samples for each of P prompts with the vLLM engine (+ the newest adapter), keeping the
                   engine's log-probs of the sampled tokens;
  2. reward        grade with math-verify (process pool, own timeouts), DAPO overlong shaping;
  3. filter        dynamic sampling: drop groups whose rewards are all equal, refill with new prompts;
  4. advantages    group-relative (mean-centred, optionally std-scaled);
  5. train         release the engine's KV cache, recompute log-probs on the trainer (same base weights),
                   DAPO loss with truncated importance sampling against the engine's log-probs, AdamW;
  6. publish       the adapter goes to the engine in memory under a new name; KV cache re-acquired;
  7. probe         the engine continues a fixed set of prompts; the trainer scores them under the new adapter,
                   the previous one and none: the engine must sit nearer the new one (epirl/rl/probe.py);
  8. log / save    metrics to JSONL + W&B, checkpoints for exact resume.
Shapes: P prompts, G samples per prompt, B = P·G sequences, T tokens.

Under torchrun every rank runs this loop with its own engine and trainer on its slice of one global batch;
the collectives it needs (identities for one process) live in epirl.rl.distributed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from epirl import hub
from epirl.checkpoint import checkpoint_world_size, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint
from epirl.config import ConfigError, EpirlConfig, dump_config, first_line, resolve_model_path, resolve_runtime
from epirl.data import Prompt, PromptStream, load_problems, render_prompt
from epirl.engine import RolloutEngine
from epirl.engine.engine import check_vllm_args
from epirl.model import Policy, load_policy, save_adapter
from epirl.model.dummy import prepare as prepare_random_weights
from epirl.model.dummy import uses_tokenizer
from epirl.model.memory import log_memory_plan, memory_plan, preflight_beside_engine
from epirl.rewards import RewardPool, overlong_penalty
from epirl.rl import benchmark as bench
from epirl.rl import distributed
from epirl.rl.advantages import group_advantages, informative_groups
from epirl.rl.distributed import Ranks, rank_slice, redistribute, reduce_metrics
from epirl.rl.hooks import PeriodicEval, periodic_mismatch
from epirl.rl.probe import ProbeMismatch, PublishProbe  # noqa: F401 - ProbeMismatch is part of the loop's API
from epirl.rl.trainer import build_batch, build_optimizer, train_step
from epirl.tracking import PhaseTimer, Tracker, memory_metrics

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt and its G completions with rewards (correctness + shaping) and advantages."""

    prompt: Prompt
    completions: list  # list[epirl.engine.Completion], length G
    correct_G: torch.Tensor
    rewards_G: torch.Tensor
    advantages_G: torch.Tensor | None = None


@dataclass
class Run:
    """The live parts of one training run, built once by `start_run` and handed to every step."""

    cfg: EpirlConfig
    engine: RolloutEngine
    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: PromptStream
    pool: RewardPool
    device: torch.device
    pad_id: int
    probe: PublishProbe | None = None
    """The post-publish probe (its prompts: the data's first problems, fixed for the whole run); None = off."""
    tracker: Tracker | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    benchmark: bench.BenchmarkSettings | None = None
    """`epirl train --benchmark`: synthetic prompts, coin rewards, no checkpoints (epirl/rl/benchmark.py)."""
    ranks: Ranks = field(default_factory=Ranks)
    """This process's place among the data-parallel ranks (one rank: collectives are identities)."""


@dataclass
class StepResult:
    """What one step hands back: its metrics, a few sample rows for the tracker, and its prompts."""

    metrics: dict[str, float]
    samples: list[dict]
    prompt_ids: list[list[int]]


@dataclass
class GroupSummary:
    """What every rank learns about every group of a round (all-gathered): enough for the dynamic-sampling
    decision and the rollout metrics."""

    correct_G: torch.Tensor
    rewards_G: torch.Tensor
    lengths_G: torch.Tensor
    truncated_G: torch.Tensor

    @classmethod
    def of(cls, g: Group) -> "GroupSummary":
        return cls(g.correct_G, g.rewards_G, torch.tensor([len(c.token_ids) for c in g.completions], dtype=torch.float32),
                   torch.tensor([c.finish_reason == "length" for c in g.completions], dtype=torch.float32))


def step_seed(seed: int, step: int, round_: int) -> int:
    # Sampling randomness is a pure function of (seed, step, round): a resumed run samples exactly what the
    # uninterrupted run sampled. vLLM runs in-process, so the global torch generators drive its sampler.
    return (seed * 1_000_003 + step * 101 + round_) % (2**31 - 1)


def prompt_seed(seed: int, position: int) -> int:
    """`rl.sample_seeding: prompt`: the sampler seed of the prompt drawn at `position` of the stream
    (splitmix64 of both: vLLM seeds sample i of a prompt with seed + i, so neighbours must not be adjacent)."""
    mask = 2**64 - 1
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 30)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) % (2**31 - 2**16)


def grade_groups(prompts: list[Prompt], completions_P_G: list[list], pool, cfg: EpirlConfig) -> tuple[list[Group], dict]:
    texts = [c.text for group in completions_P_G for c in group]
    truths = [p.problem.ground_truth for p, group in zip(prompts, completions_P_G) for _ in group]
    correct, stats = pool.grade_batch(texts, truths, cfg.reward.style)
    G = cfg.rl.samples_per_prompt
    correct_P_G = torch.tensor(correct, dtype=torch.float32).view(len(prompts), G)
    lengths_P_G = torch.tensor([len(c.token_ids) for group in completions_P_G for c in group]).view(len(prompts), G)
    shaping_P_G = torch.tensor([overlong_penalty(n, cfg.rl.max_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
                                for n in lengths_P_G.flatten().tolist()]).view(len(prompts), G)
    rewards_P_G = correct_P_G + shaping_P_G
    groups = [Group(p, comps, correct_P_G[i], rewards_P_G[i]) for i, (p, comps) in enumerate(zip(prompts, completions_P_G))]
    return groups, stats


def collect_rollouts(engine, stream: PromptStream, pool, cfg: EpirlConfig, step: int, timer: PhaseTimer | None = None,
                     ignore_eos: bool = False, ranks: Ranks | None = None) -> tuple[list[Group], dict]:
    """Generate and grade until P informative groups are collected (over all ranks) or the refill rounds run
    out; returns this rank's part of the batch. Every rank draws the same prompts and generates its slice;
    the keep decision is made from all-gathered summaries, so it is the same everywhere."""
    rl, ranks, timer = cfg.rl, ranks or Ranks(), timer or PhaseTimer()
    kept: list[tuple[int, int]] = []  # (round, index in the round) of kept groups, global order
    seen: list[GroupSummary] = []
    mine: dict[tuple[int, int], Group] = {}
    totals: dict[str, float] = {}
    for round_ in range(rl.max_refill_rounds + 1 if rl.dynamic_sampling else 1):
        need = rl.prompts_per_step - len(kept)
        part = rank_slice(need, ranks.world, ranks.rank)
        groups, stats = generate_and_grade(engine, stream.take(need)[part], pool, cfg, (step, round_, ranks.rank),
                                           timer, ignore_eos)
        mine |= {(round_, part.start + i): g for i, g in enumerate(groups)}
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
        summaries = [s for rank_part in ranks.all_gather_object([GroupSummary.of(g) for g in groups]) for s in rank_part]
        keep = informative(summaries) if rl.dynamic_sampling else [True] * len(summaries)
        seen += summaries
        kept += [(round_, i) for i, k in enumerate(keep) if k]
        if len(kept) >= rl.prompts_per_step:
            break
    kept = kept[: rl.prompts_per_step]
    metrics = rollout_metrics(seen, len(kept)) | totals | {"rollout/rounds": float(round_ + 1)}
    return redistribute(kept, mine, ranks), metrics


def generate_and_grade(engine, prompts: list[Prompt], pool, cfg: EpirlConfig, where: tuple[int, int, int],
                       timer: PhaseTimer, ignore_eos: bool = False) -> tuple[list[Group], dict]:
    """`where` = (step, round, rank): what seeds the sampler."""
    if not prompts:  # more ranks than prompts left to draw
        return [], {}
    rl, (step, round_, rank) = cfg.rl, where
    # Rank 0 samples as a single process does; other ranks seed their own stream (per-step seeding).
    torch.manual_seed((step_seed(cfg.seed, step, round_) + rank * 104_729) % (2**31 - 1))
    seeds = [prompt_seed(cfg.seed, p.position) for p in prompts] if rl.sample_seeding == "prompt" else None
    with timer("generate"):
        completions_P_G = engine.generate([p.token_ids for p in prompts], n=rl.samples_per_prompt,
                                          max_tokens=rl.max_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                          ignore_eos=ignore_eos, seeds=seeds)
    with timer("score"):
        return grade_groups(prompts, completions_P_G, pool, cfg)


def informative(groups: list[GroupSummary]) -> list[bool]:
    """DAPO's dynamic-sampling filter, on accuracy: an all-wrong (or all-right) group whose only spread is the
    overlong penalty carries no correctness signal, and std scaling would blow that length difference up
    to full-size advantages."""
    if not groups:
        return []
    return informative_groups(torch.stack([g.correct_G.float() for g in groups])).tolist()


def rollout_metrics(seen: list[GroupSummary], kept: int) -> dict[str, float]:
    """Reward/accuracy over everything generated this step (the honest curve), lengths, filter stats."""
    rewards = torch.cat([g.rewards_G for g in seen])
    correct = torch.cat([g.correct_G for g in seen])
    lengths = torch.cat([g.lengths_G for g in seen])
    truncated = torch.cat([g.truncated_G for g in seen])
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "reward/accuracy": correct.mean().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": truncated.mean().item(),
        "rollout/generated_tokens": lengths.sum().item(),  # over all ranks (the summaries are all-gathered)
        "rollout/groups_generated": float(len(seen)),
        "rollout/groups_kept": float(kept),
        "rollout/informative_frac": kept / max(len(seen), 1),
    }


def groups_to_batch(groups: list[Group], cfg: EpirlConfig, pad_id: int):
    sequences = []
    for g in groups:
        g.advantages_G = group_advantages(g.rewards_G[None], cfg.rl.std_normalize)[0]
        for comp, adv in zip(g.completions, g.advantages_G.tolist()):
            if comp.token_ids:  # an empty completion has no token to learn from
                sequences.append((g.prompt.token_ids, list(comp.token_ids), list(comp.logprobs), adv))
    return build_batch(sequences, pad_id) if sequences else None


def sample_rows(groups: list[Group], tokenizer, count: int) -> list[dict]:
    if tokenizer is None:  # token-id prompts (random weights without a tokenizer): nothing to read
        return []
    rows = []
    for g in groups[:count]:
        c = g.completions[0]
        rows.append({"prompt": tokenizer.decode(g.prompt.token_ids), "completion": c.text,
                     "ground_truth": g.prompt.problem.ground_truth, "reward": float(g.rewards_G[0])})
    return rows


def train(cfg: EpirlConfig, resume: Path | None = None, progress=None,
          benchmark: bench.BenchmarkSettings | None = None, problems: list | None = None) -> Path:
    """Run (or resume) a GRPO/DAPO training job; returns the run folder.

    `progress`: an observer (`epirl.progress.RunProgress`): `progress.started(start_step, memory_report)` once
    the engine and trainer are up, then `progress(step, metrics)` after every step. `benchmark`: the same loop
    for `benchmark.steps` steps on synthetic token-id prompts with seeded-coin rewards; writes benchmark.json
    instead of checkpoints and an adapter (epirl/rl/benchmark.py). `problems`: the output of
    `check_inputs(cfg)` when the caller has run it already."""
    if cfg.model.load_format == "dummy":
        prepare_random_weights(cfg)  # model.path becomes the folder of the architecture's config; one log line
    if problems is None:  # bad model path, data, vLLM arguments: one line, before anything starts
        problems = check_inputs(cfg, need_data=benchmark is None)
    device = resolve_runtime(cfg)
    # a benchmark's synthetic prompts have their own length: plan the batch the run will really train on
    plan = memory_plan(cfg, device, prompt_tokens=bench.prompt_length(cfg, benchmark) if benchmark else None)
    log_memory_plan(plan)  # before the engine starts: what the recipe should take
    run_dir = Path(resume) if resume else cfg.run_dir
    if resume and latest_checkpoint(run_dir) is None:  # before anything is written or started
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    ranks = distributed.setup(cfg.distributed.timeout_s, device.type == "cuda")
    tracker = engine = None
    try:  # every exit path tears the process group down: no rank waits on a collective that never comes
        check_resume_world(run_dir if resume else None, ranks)
        if device.type == "cuda":  # fail in seconds, before the engine loads, when the trainer cannot fit
            preflight_beside_engine(cfg, device)
        if ranks.is_main:  # one writer of the run folder
            run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, run_dir / "config.yaml")
            tracker = Tracker(cfg, run_dir, resume=resume is not None)
        engine = RolloutEngine(cfg, **distributed.engine_overrides(ranks))
        pool = bench.CoinRewards(cfg.seed) if benchmark else RewardPool(cfg.reward.workers, cfg.reward.timeout_s)
        with pool:
            run = start_run(cfg, engine, pool, device, problems, tracker, benchmark, ranks)
            start_step = restore(run, run_dir) if resume else 0
            run_steps(run, run_dir, start_step, progress if ranks.is_main else None, plan)
    finally:
        if tracker is not None:
            tracker.close()
        if engine is not None:
            engine.close()
        distributed.teardown()
    return run_dir


def check_resume_world(run_dir: Path | None, ranks: Ranks) -> None:
    """A checkpoint continues exactly only with the rank count that wrote it (each rank's RNG state)."""
    if run_dir is None:
        return
    written_by = checkpoint_world_size(latest_checkpoint(run_dir))
    if written_by != ranks.world:
        raise ConfigError(f"--resume {run_dir}: the checkpoint was written by {written_by} rank(s), this job has "
                          f"{ranks.world}; resume with --nproc {written_by} (torchrun --nproc-per-node {written_by})")


def check_inputs(cfg: EpirlConfig, need_data: bool = True) -> list:
    """The recipe's inputs, checked before a run folder or an engine exists; returns the problems.

    Raises ConfigError / DataError with one line naming the field or file."""
    if cfg.model.path == resolve_model_path(cfg.model.path):  # not an alias of a pip-shipped model
        local = hub.local_path(cfg.model.path)
        if local is None:  # a hub id: one line when the hub cannot be reached, instead of a minute of retries
            hub.require_hub("model.path", cfg.model.path, ConfigError)
        elif not local.is_dir():
            raise ConfigError(f"model.path: {cfg.model.path}: no such folder")
    try:  # a folder, an alias or a hub id: its config only (the weights come after the memory pre-flight)
        AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    except Exception as exc:  # noqa: BLE001 - missing folder, bad hub id, offline: all one line
        reason = first_line(exc)
        raise ConfigError(f"model.path: {cfg.model.path}: {reason}") from None
    check_vllm_args(cfg)
    if not need_data:
        return []
    if not uses_tokenizer(cfg):
        raise ConfigError("model.load_format=dummy: this config has no tokenizer, so prompts can only be token ids: "
                          "run `epirl train ... --benchmark N`, or set model.tokenizer")
    return load_problems(cfg.data, cfg.seed)


def start_run(cfg: EpirlConfig, engine: RolloutEngine, pool, device: torch.device, problems: list,
              tracker: Tracker | None = None, benchmark: bench.BenchmarkSettings | None = None,
              ranks: Ranks | None = None) -> Run:
    """The trainer beside a started engine (policy, optimizer, prompt stream, post-publish probe)."""
    policy = load_policy(cfg, device, engine=engine)
    optimizer, scheduler = build_optimizer(policy.lora_parameters(), cfg)
    tokenizer = engine.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    if benchmark is not None:
        stream = bench.SyntheticPrompts(cfg, benchmark)
        probe_prompts = bench.probe_prompts(cfg, benchmark)
    else:
        stream = PromptStream(problems, tokenizer, seed=cfg.seed, shuffle=cfg.data.shuffle,
                              thinking=cfg.model.thinking, max_prompt_tokens=cfg.prompt_token_limit)
        # A fixed probe set for the whole run (the first problems in file order; the stream is not touched).
        probe_prompts = [render_prompt(tokenizer, p.messages, cfg.model.thinking)
                         for p in problems[: cfg.engine.probe_prompts]]
    # Random weights: engine and trainer hold different values (epirl.model.dummy), so the probe only reports.
    probe = (PublishProbe(cfg, probe_prompts, device, pad_id, enforce=cfg.model.load_format != "dummy")
             if probe_prompts else None)
    return Run(cfg, engine, policy, optimizer, scheduler, stream, pool, device, pad_id, probe, tracker,
               benchmark=benchmark, ranks=ranks or Ranks())


def restore(run: Run, run_dir: Path) -> int:
    """Load the latest checkpoint of `run_dir` into the run; returns the step to continue from."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return 0
    state = load_checkpoint(checkpoint, policy=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,
                            rank=run.ranks.rank)
    run.stream.load_state_dict(state["data"])
    if run.tracker is not None:
        run.tracker.forget_after(state["step"])  # steps after the checkpoint run again: log them once
    log.info("resumed from %s at step %d", checkpoint, state["step"])
    return state["step"]


def run_steps(run: Run, run_dir: Path, start_step: int, progress=None, plan: dict | None = None) -> None:
    """Steps `start_step` .. `rl.steps` (or `benchmark.steps` more): each step, then in-training eval /
    mismatch, logging, checkpoints; a benchmark records its rows instead of saving anything. With several
    ranks, rank 0 alone measures (eval, mismatch on its engine), records, logs and saves."""
    cfg, tracker, main = run.cfg, run.tracker, run.ranks.is_main
    random_weights = float(cfg.model.load_format == "dummy")
    run.engine.publish(run.policy.lora_state_dict(), step=start_step)  # the engine always samples with our adapter
    if run.probe is not None:
        run.probe(run.engine, run.policy, None, start_step)  # the noise floor (a fresh adapter is zero: new = base)
    if tracker is not None:
        tracker.summary(run.policy.memory_report() | {"model/random_weights": random_weights})
    if progress is not None:
        progress.started(start_step, run.policy.memory_report())
    recorder = bench.Recorder(cfg, run.benchmark, plan, run.engine, run_dir) if run.benchmark and main else None
    evaluate = PeriodicEval(cfg, run_dir) if run.benchmark is None and main else None
    last_step = start_step + run.benchmark.steps if run.benchmark else cfg.rl.steps
    for step in range(start_step, last_step):
        result = run_step(run, step)
        metrics = result.metrics | {"model/random_weights": random_weights}
        if recorder is not None:
            metrics |= recorder.record(step + 1, metrics, run.policy, run.optimizer)
        elif evaluate is not None:
            if evaluate.due(step + 1):
                metrics |= evaluate(step + 1, run.engine, run.pool)
            metrics |= periodic_mismatch(step + 1, cfg, run.engine, run.policy, result.prompt_ids, run.device)
        if tracker is not None:
            tracker.log(step + 1, metrics)
            if cfg.tracking.samples_every and (step + 1) % cfg.tracking.samples_every == 0 and result.samples:
                tracker.log_samples(step + 1, result.samples)
        if progress is not None:
            progress(step + 1, metrics)
        if run.benchmark is None:
            maybe_checkpoint(run, run_dir, step + 1)
    if recorder is not None:
        recorder.finish()
    elif run.benchmark is None and main:
        save_adapter(run.policy, run_dir / "adapter", cfg)


def maybe_checkpoint(run: Run, run_dir: Path, step: int) -> None:
    cfg = run.cfg
    if step == cfg.rl.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        rng_by_rank = run.ranks.all_gather_object(rng_state())  # each rank resumes its own RNG
        if run.ranks.is_main:
            save_checkpoint(run_dir, step, policy=run.policy, cfg=cfg, optimizer=run.optimizer,
                            scheduler=run.scheduler, data_state=run.stream.state_dict(),
                            keep_last=cfg.checkpoint.keep_last, rng_by_rank=rng_by_rank)


def run_step(run: Run, step: int) -> StepResult:
    """One GRPO step (module docstring, 1-7): rollouts, release, train, publish, re-acquire, probe."""
    cfg, engine, policy, timer, ranks = run.cfg, run.engine, run.policy, run.timer, run.ranks
    ignore_eos = run.benchmark is not None and run.benchmark.force_max_tokens
    groups, metrics = collect_rollouts(engine, run.stream, run.pool, cfg, step, timer, ignore_eos, ranks)
    batch = groups_to_batch(groups, cfg, run.pad_id)
    with timer("release_kv"):
        metrics |= engine.release_kv()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with timer("train"):
        if ranks.any(batch is not None and bool((batch.advantages_B != 0).any())):
            metrics |= train_step(policy, run.optimizer, run.scheduler, batch, cfg, run.device, ranks)
            metrics["train/skipped"] = 0.0
            metrics["train/processed_tokens"] = float(sum(len(g.prompt.token_ids) + len(c.token_ids)
                                                          for g in groups for c in g.completions if c.token_ids))
        else:  # every group had equal rewards: no gradient signal, keep the adapter as it is
            metrics["train/skipped"] = 1.0
    if ranks.distributed:  # identical optimizer steps must leave identical adapters
        metrics["dist/adapter_checksum"] = ranks.check_adapter(policy.lora_parameters(), step + 1)
    previous = engine.adapter.tensors if engine.adapter is not None else None  # what the probe tells apart
    with timer("publish"):
        metrics |= engine.publish(policy.lora_state_dict(), step=step + 1)
    with timer("reacquire_kv"):
        metrics |= engine.reacquire_kv()
    if run.probe is not None:
        with timer("probe"):
            metrics |= run.probe(engine, policy, previous, step + 1)
    metrics |= timer.pop() | memory_metrics()
    metrics |= {f"mem/trainer_{k}": float(v) for k, v in policy.memory_report().items() if isinstance(v, (int, float))}
    metrics["time/step_s"] = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step_s")
    metrics["data/cursor"] = float(run.stream.cursor)
    if ranks.distributed:
        metrics = reduce_metrics(ranks.all_gather_object(metrics))
    return StepResult(metrics, sample_rows(groups, engine.tokenizer, cfg.tracking.samples_count),
                      [g.prompt.token_ids for g in groups])
