"""The GPU loop check every kernel change runs: the SmolLM2 recipe with real weights under each engine/trainer pairing,
CUDA graphs on, KV release on, the probe on, and one table.

    source scripts/offline/device_env.sh && python3 -P scripts/gpu_loop_check.py            # vLLM staged on the GPU machine
    python3 -P scripts/gpu_loop_check.py --steps 20 --pairings bf16,w8a16 --faults none [key=value ...]

A 20-step run takes ~150 s on an H100 alone, 83 s of it engine and trainer start-up with CUDA-graph capture (a W8A8
engine with `engine.serving_kernels=auto` also times its dispatch at start: over 260 s). So the runs share the GPU:
one chain per pairing (the pairing, then the faults injected into it, which find its compile cache warm) and the chains
side by side (--jobs, default all), each engine with a fixed KV cache (--kv-cache-gib) so that no engine sizes its
cache from free memory another is still allocating. Rows print as each run ends; --pairings / --faults split the
check over several calls where one is too short.

Each pairing runs `epirl train recipes/smollm2_arith_cpu.yaml` in its own process (a normal run folder under
--output-dir). Then fault injections run a pairing with a broken publish and must be stopped by the probe: `skip`
(matched pairing) and `skip-w8a8` (the W8A8 default): from step 3 on the engine keeps the adapter it has; `stale`
(matched): from step 3 on every new request is served with the previous adapter's tensors, one step behind.

Printed: per pairing the steps completed, whether the probe stopped it, KL(engine‖trainer) first / median / last
and the median ratio to the bf16 pairing's, the median fraction of tokens whose engine and trainer log-probs are
bitwise equal (`mismatch/bitwise_frac`), the probe's arrival fraction against the previous adapter (median, lowest
resolved), and accuracy first -> last. Exit 1 when a healthy pairing stops or fails, when the matched pairing's median
KL exceeds 1.2x the bf16 pairing's, or when a fault injection is not stopped by the probe.

Where a pairing fails, `--diagnose PAIRING` finds where its engine and trainer part ways under a *trained* adapter:

    python3 -P scripts/gpu_loop_check.py --diagnose w8a16-bitwise --steps 2 --eager [key=value ...]

It trains PAIRING in this process and, after every publish, the engine samples the probe prompts (decode log-probs `e`)
and re-scores them itself (prefill, under the new adapter, the previous one re-published, and none), and the trainer
scores them under new / old / base, under the new step amplified (old + k (new - old)), and with FP8 activations
(variant c) where it has FP8 projections. Printed per step (`DIAG` lines): the arrival fraction β of `e` against each
reference pair, the fraction of tokens on which decode, prefill and trainer agree bit for bit, and how much of the
trainer's own one-step separation another arithmetic reproduces (the reliability of δ: 1 = the step's effect on the
log-probs is the same in both arithmetics, small = rounding flips dominate it). With an eager matched engine it also
checks every LoRA layer (`LAYERS` lines): the engine's adapter buffers equal the trainer's parameters, and a captured
decode call equals the trainer's module on the same input, bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from epirl.compare.plan import read_metric_rows

ROOT = Path(__file__).resolve().parents[1]
PAIRINGS = {
    "bf16": ["engine.precision=bf16", "trainer.base=bf16", "rl.correction=tis"],
    "w8a16": ["engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none"],
    "w8a16-noslices": ["engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none", "kernels.fused_slices=false"],
    "w8a16-bitwise": ["engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none", "engine.bitwise=true"],
    "w8a8": ["engine.precision=w8a8", "trainer.base=fp8", "rl.correction=tis", "engine.serving_kernels=auto"],
    "w8a8-off": ["engine.precision=w8a8", "trainer.base=fp8", "rl.correction=tis", "engine.serving_kernels=off"],
}
MATCHED = ("w8a16", "w8a16-noslices")
BITWISE = ("w8a16-bitwise",)  # must agree bit for bit on every step: `mismatch/bitwise_frac` = 1
KL_RATIO_LIMIT = 1.2
FAULTS = {"skip": "w8a16", "stale": "w8a16", "skip-w8a8": "w8a8"}  # fault -> the pairing it is injected into
# Steps of a fault run (the publish broken from FAULT_FROM_STEP on). A W8A8 engine's noise is ~10x the matched one's, so
# a skipped publish becomes decidable only once the adapter has moved well past the one the engine kept: against the base
# model the engine then sits near β = FAULT_FROM_STEP / step, and a healthy W8A8 run's lowest resolved β was 0.71.
FAULT_STEPS = {"skip": 10, "stale": 10, "skip-w8a8": 20}
FAULT_FROM_STEP = 3


def common_overrides(args, name: str, steps: int) -> list[str]:
    return [f"name={name}", f"output_dir={args.output_dir}", "tracking.wandb=disabled", f"rl.steps={steps}",
            f"engine.gpu_memory_utilization={args.gpu_memory_utilization}", "checkpoint.every=0",
            "model.max_model_len=512", f"engine.enforce_eager={str(args.eager).lower()}",
            f"engine.vllm_args.kv_cache_memory_bytes={int(args.kv_cache_gib * 2**30)}"]


def run_pairing(args, pairing: str, fault: str | None = None) -> dict:
    """One training run in its own process; returns its row (metrics and how it ended)."""
    name = f"loop_{pairing}" + (f"_fault_{fault}" if fault else "")
    steps = (args.fault_steps or FAULT_STEPS[fault]) if fault else args.steps
    overrides = common_overrides(args, name, steps) + PAIRINGS[pairing] + args.extra
    if fault:  # the run goes through this file's `inject` entry, which breaks the publish and starts `epirl train`
        command = [sys.executable, "-P", str(Path(__file__).resolve()), "--inject", fault, "--",
                   "train", "recipes/smollm2_arith_cpu.yaml", *overrides]
    else:
        command = [sys.executable, "-P", "-m", "epirl.cli", "train", "recipes/smollm2_arith_cpu.yaml", *overrides]
    run_dir = Path(args.output_dir, name)
    for stale in (run_dir, run_dir.with_name(name + ".failed")):
        subprocess.run(["rm", "-rf", str(stale)], check=False)
    t0 = time.time()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        returncode, console = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as timeout:  # a row all the same: what the run wrote until then
        returncode = 124
        console = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                          for part in (timeout.stdout, timeout.stderr)) + f"\ntimed out after {args.timeout} s"
    Path(args.output_dir, name + ".console").write_text(console)
    row = {"pairing": pairing, "fault": fault, "rc": returncode, "seconds": time.time() - t0,
           "probe_stop": "ProbeMismatch" in console or "does not serve the adapter" in console
           or "serves none of the adapter" in console}
    steps = read_metric_rows(run_dir)  # one row per step; torn lines skipped
    row["steps"] = len(steps)
    kl = [s["mismatch/k3_kl"] for s in steps if "mismatch/k3_kl" in s]
    row["kl"] = kl
    bitwise = [s["mismatch/bitwise_frac"] for s in steps if "mismatch/bitwise_frac" in s]
    row["bitwise"] = statistics.median(bitwise) if bitwise else None
    row["bitwise_min"] = min(bitwise) if bitwise else None
    for alt in ("old", "base"):  # the probe's decided fits, and the plain fit on the same steps (not decided on)
        resolved = [s for s in steps if s.get(f"probe/separation_vs_{alt}", 0.0) >= args.probe_separation]
        row[f"resolved_{alt}"] = len(resolved)
        for key, metric in (("beta", "arrival"), ("plain", "plain_arrival"), ("reliability", "reliability")):
            values = [s[f"probe/{metric}_vs_{alt}"] for s in resolved if f"probe/{metric}_vs_{alt}" in s]
            row[f"{key}_{alt}"] = (statistics.median(values), min(values)) if values else None
    acc = [s["reward/accuracy"] for s in steps if "reward/accuracy" in s]
    row["acc"] = (acc[0], acc[-1]) if acc else None
    if returncode != 0:
        lines = [ln for ln in console.splitlines() if ln.strip()]
        row["last_line"] = lines[-1][:300] if lines else ""
    return row


def inject(fault: str, cli_args: list[str]) -> int:
    """`epirl train` with the publish broken from step FAULT_FROM_STEP on (the probe must stop the run)."""
    from epirl import cli
    from epirl.engine import lora_publish

    publish = lora_publish.AdapterPublisher.publish
    build = lora_publish.lora_model_from_tensors

    def broken_publish(self, tensors, step):
        if step >= FAULT_FROM_STEP and self.current is not None:
            if fault.startswith("skip"):  # the engine keeps serving what it has: no publish at all
                return {}
            if fault == "stale":  # a new request whose slot is filled with the previous adapter's tensors
                previous = self.current
                stale = {self._names.vllm_adapter_key(k): v.clone() for k, v in previous.tensors.items()}
                lora_publish.lora_model_from_tensors = lambda mgr, lora_id, _tensors, *rest: build(
                    mgr, lora_id, {k: v.clone() for k, v in stale.items()}, *rest)
                metrics = publish(self, tensors, step)
                self.current.modules = previous.modules  # what the matched engine's own buffers load from
                return metrics
        return publish(self, tensors, step)

    lora_publish.AdapterPublisher.publish = broken_publish
    return cli.main(cli_args)


def fmt(value, spec="{:.2e}") -> str:
    return "–" if value is None else spec.format(value)


def pair(values, spec="{:.2f}") -> str:
    return "–" if values is None else f"{spec.format(values[0])} ({spec.format(values[1])})"


def table(rows: list[dict], bf16_median: float | None) -> str:
    lines = ["| pairing | steps | probe stop | KL(engine‖trainer) first / median / last | median KL ÷ bf16 | bitwise median (lowest) | "
             "resolved vs old / base | β vs old: median (lowest) | plain fit vs old | reliability vs old | "
             "β vs base | accuracy first → last | s |", "|---" * 13 + "|"]
    for r in rows:
        kl = r["kl"]
        median = statistics.median(kl) if kl else None
        ratio = median / bf16_median if median is not None and bf16_median else None
        name = r["pairing"] + (f" + fault `{r['fault']}`" if r["fault"] else "")
        acc = f"{r['acc'][0]:.3f} → {r['acc'][1]:.3f}" if r["acc"] else "–"
        lines.append(f"| {name} | {r['steps']} | {'**yes**' if r['probe_stop'] else 'no'} | "
                     f"{fmt(kl[0] if kl else None)} / {fmt(median)} / {fmt(kl[-1] if kl else None)} | "
                     f"{fmt(ratio, '{:.2f}')} | {fmt(r.get('bitwise'), '{:.3f}')} ({fmt(r.get('bitwise_min'), '{:.4f}')}) | {r['resolved_old']} / {r['resolved_base']} | {pair(r['beta_old'])} | "
                     f"{pair(r['plain_old'])} | {pair(r['reliability_old'])} | {pair(r['beta_base'])} | {acc} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def verdict(rows: list[dict], steps: int, bf16_median: float | None) -> list[str]:
    problems = []
    for r in rows:
        if r["fault"]:
            if not r["probe_stop"]:
                problems.append(f"fault {r['fault']} in {r['pairing']}: not stopped by the probe")
            continue
        if r["rc"] != 0 or r["steps"] < steps:
            problems.append(f"{r['pairing']}: {r['steps']} of {steps} steps, rc {r['rc']}"
                            + (" (probe stop)" if r["probe_stop"] else "") + f": {r.get('last_line', '')}")
        if r["pairing"] in BITWISE and not r["fault"] and (r.get("bitwise_min") or 0.0) < 1.0:
            problems.append(f"{r['pairing']}: bitwise fraction {fmt(r.get('bitwise_min'), '{:.4f}')} < 1 at some step")
        if r["pairing"] in MATCHED and r["kl"] and bf16_median:
            ratio = statistics.median(r["kl"]) / bf16_median
            if ratio > KL_RATIO_LIMIT:
                problems.append(f"{r['pairing']}: median KL {ratio:.2f}x the bf16 pairing's (limit {KL_RATIO_LIMIT})")
    return problems


def chains(pairings: list[str], faults: list[str]) -> list[list[tuple[str, str | None]]]:
    """One chain per pairing: the pairing's own run, then the fault runs injected into it (same compile-cache key:
    they start on its warm cache, and two processes never compile the same key at once). A fault whose pairing is not
    asked for forms its own chain after the pairing's."""
    ordered: dict[str, list[tuple[str, str | None]]] = {p: [(p, None)] for p in pairings}
    for fault in faults:
        ordered.setdefault(FAULTS[fault], []).append((FAULTS[fault], fault))
    return list(ordered.values())


def run_chains(args, work: list[list[tuple[str, str | None]]]) -> list[dict]:
    """Every chain's runs in order, up to args.jobs chains at once; prints each row as its run ends. Returns the rows in
    chain order (pairings first as asked, then their faults)."""
    rows: dict[tuple[str, str | None], dict] = {}
    lock = threading.Lock()

    def run_chain(chain):
        for pairing, fault in chain:
            row = run_pairing(args, pairing, fault)
            with lock:
                rows[(pairing, fault)] = row
                print(table([row], None).splitlines()[-1], flush=True)  # as it comes (a killed call keeps them)

    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs or len(work), len(work)))) as pool:
        for future in [pool.submit(run_chain, chain) for chain in work]:
            future.result()
    order = [key for chain in work for key in chain if key[1] is None] + [key for chain in work for key in chain
                                                                         if key[1] is not None]
    return [rows[key] for key in order]


# --diagnose: the probe's tokens against every reference after each publish

def beta(e, new, alt):
    d = new - alt
    n2 = float(d.pow(2).sum())
    return float(((e - alt) * d).sum()) / n2 if n2 > 0 else float("nan")


def rms(x):
    return float(x.pow(2).mean().sqrt())


def equal_fraction(a, b):
    return float((a == b).float().mean()) if a.numel() else float("nan")


def reliability(d_ref, d_other):
    n2 = float(d_ref.pow(2).sum())
    return float((d_ref * d_other).sum()) / n2 if n2 > 0 else float("nan")


def flat(lists):
    import torch

    return torch.tensor([v for row in lists for v in row], dtype=torch.float32)


def analyze(probe, engine, policy, previous, step, rows: list):
    """One publish of `--diagnose`: the probe's tokens scored against every reference; appends the step's row."""
    import torch  # deferred, as the engine and trainer modules: the check's own process only starts runs

    from epirl.engine.matched_check import capture_lora_layers, compare_with_trainer
    from epirl.mismatch.variants import fake_quant_activations, fp8_projections
    from epirl.rl.probe import dithered_roundings, lora_swapped
    from epirl.rl.trainer import build_batch

    cfg = probe.cfg
    torch.manual_seed(cfg.seed)
    max_tokens = min(cfg.engine.probe_tokens, cfg.rl.max_tokens)
    with capture_lora_layers(engine) as captured:
        outs = engine.generate(probe.prompts, n=1, max_tokens=max_tokens, temperature=cfg.rl.temperature)
    if captured:
        print(f"LAYERS step {step}: {compare_with_trainer(captured, policy)}", flush=True)
    picks = [(p, list(o[0].token_ids), list(o[0].logprobs), 0.0) for p, o in zip(probe.prompts, outs)
             if o[0].token_ids]
    prompts, comps = [p for p, *_ in picks], [c for _, c, *_ in picks]
    batch = build_batch(picks, probe.pad_id).to(probe.device)
    e = batch.engine_logprobs_B_T[batch.mask_B_T].float().cpu()
    new_tensors = policy.lora_state_dict()
    row = {"step": step, "tokens": e.numel()}
    row["eng_pre_new"] = flat(engine.score(prompts, comps, cfg.rl.temperature))
    row["eng_pre_base"] = flat(engine.score(prompts, comps, cfg.rl.temperature, use_adapter=False))
    if previous is not None:
        engine.publish(previous, step=step)  # the previous adapter, re-published, scored by the engine itself
        row["eng_pre_old"] = flat(engine.score(prompts, comps, cfg.rl.temperature))
        engine.publish(new_tensors, step=step)
    quantized = cfg.engine.precision == "w8a8" and bool(fp8_projections(policy))

    def score(quant=False, train_mode=False):
        policy.model.train(train_mode)
        with torch.no_grad(), (fake_quant_activations(policy) if quant else contextlib.nullcontext()):
            lp, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, cfg.rl.temperature,
                                          cfg.trainer.logprob_chunk_tokens)
        return lp.float()[batch.mask_B_T].cpu()

    variants = [False, True] if fp8_projections(policy) else [False]
    for quant in variants:
        tag = "c" if quant else "b"
        row[f"new_{tag}"] = score(quant)
        with policy.adapter_disabled():
            row[f"base_{tag}"] = score(quant)
        if previous is not None:
            with lora_swapped(policy, previous):
                row[f"old_{tag}"] = score(quant)
            for k in (4, 16):
                amp = {n: previous[n].float() + k * (new_tensors[n].float() - previous[n].float()) for n in new_tensors}
                with lora_swapped(policy, amp):
                    row[f"amp{k}_{tag}"] = score(quant)
            with dithered_roundings(policy):  # the same hypotheses with other rounding flips: the probe's instrument
                row[f"newd_{tag}"] = score(quant)
                with lora_swapped(policy, previous):
                    row[f"oldd_{tag}"] = score(quant)
    row["new_b_train_mode"] = score(False, train_mode=True)
    policy.model.eval()
    rows.append(report(row, e, quantized))


def report(row, e, quantized) -> dict:
    ref = "c" if quantized else "b"
    out = {"step": row["step"], "tokens": row["tokens"], "ref": ref}
    new, base = row[f"new_{ref}"], row[f"base_{ref}"]
    out["rms(e-new)"] = rms(e - new)
    out["rms(e-eng_pre_new)"] = rms(e - row["eng_pre_new"])
    out["rms(eng_pre_new-new)"] = rms(row["eng_pre_new"] - new)
    out["rms(train-eval)"] = rms(row["new_b_train_mode"] - row["new_b"])
    # bitwise agreement (the bitwise pairing's target: 1.0): where decode, prefill and trainer part ways
    out["eq(e,new)"] = equal_fraction(e, new)
    out["eq(e,eng_pre_new)"] = equal_fraction(e, row["eng_pre_new"])
    out["eq(eng_pre_new,new)"] = equal_fraction(row["eng_pre_new"], new)
    out["beta_base"] = beta(e, new, base)
    out["beta_base_eng"] = beta(e, row["eng_pre_new"], row["eng_pre_base"])
    if f"old_{ref}" in row:
        old = row[f"old_{ref}"]
        d = new - old
        out["|d_old|/rms(e-new)"] = float(d.pow(2).sum().sqrt()) / max(rms(e - new), 1e-3)
        out["beta_old"] = beta(e, new, old)
        out["beta_old_prefill"] = beta(row["eng_pre_new"], new, old)
        out["beta_old_eng"] = beta(e, row["eng_pre_new"], row["eng_pre_old"])
        for k in (4, 16):
            out[f"beta_old_amp{k}"] = k * beta(e, row[f"amp{k}_{ref}"], old)
            out[f"rel_amp{k}"] = reliability(d, (row[f"amp{k}_{ref}"] - old) / k)
        out["rel_engine"] = reliability(d, row["eng_pre_new"] - row["eng_pre_old"])
        d_dither = row[f"newd_{ref}"] - row[f"oldd_{ref}"]
        out["rel_dither"] = reliability(d, d_dither)
        den = float((d * d_dither).sum())
        out["beta_old_iv"] = float(((e - old) * d_dither).sum()) / den if den else float("nan")
        out["iv_separation"] = den / (float(d_dither.pow(2).sum().sqrt()) * max(rms(e - new), 1e-3))
        if "new_c" in row and ref == "b":
            out["rel_c"] = reliability(d, row["new_c"] - row["old_c"])
        if "new_b" in row and ref == "c":
            out["rel_b"] = reliability(d, row["new_b"] - row["old_b"])
            out["beta_old_vs_b"] = beta(e, row["new_b"], row["old_b"])
    print("DIAG " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
    return out


def diagnose(args) -> int:
    """`--diagnose PAIRING`: train it here, analysing every publish (the module docstring says what is printed)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import shutil

    from epirl.config import load_config
    from epirl.rl import loop
    from epirl.rl.probe import PublishProbe

    name = f"diag_{args.diagnose}"
    overrides = [f"name={name}", f"output_dir={args.output_dir}", "tracking.wandb=disabled",
                 "engine.gpu_memory_utilization=0.25", f"engine.enforce_eager={str(args.eager).lower()}",
                 "checkpoint.every=0", f"engine.probe_prompts={args.prompts}", f"rl.steps={args.steps}",
                 *PAIRINGS[args.diagnose], *args.extra]
    cfg = load_config("recipes/smollm2_arith_cpu.yaml", overrides)
    original, rows = PublishProbe.__call__, []

    def probe_call(self, engine, policy, previous, step):
        self.enforce = False
        metrics = original(self, engine, policy, previous, step)
        print(f"PROBE step {step}: " + json.dumps({k: round(v, 4) for k, v in metrics.items()}), flush=True)
        analyze(self, engine, policy, previous, step, rows)
        return metrics

    PublishProbe.__call__ = probe_call
    shutil.rmtree(Path(args.output_dir, name), ignore_errors=True)
    run_dir = loop.train(cfg)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        print(f"STEP {m['step']}: acc {m.get('reward/accuracy', float('nan')):.3f} "
              f"kl {m.get('mismatch/k3_kl', float('nan')):.3e}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairings", default=",".join(p for p in PAIRINGS if p not in BITWISE),
                        help=f"comma-separated, of {sorted(PAIRINGS)} (default: all but {', '.join(BITWISE)})")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault injections, or none")
    parser.add_argument("--fault-steps", type=int, default=0, help="steps of every fault-injection run (broken from "
                        f"step {FAULT_FROM_STEP} on; 0: {FAULT_STEPS})")
    parser.add_argument("--eager", action="store_true", help="engine without CUDA graphs (default: graphs on)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.12,
                        help="each engine's share of the GPU (the runs share it: keep jobs x this < ~0.8)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="each engine's fixed KV cache")
    parser.add_argument("--jobs", type=int, default=0, help="chains run side by side (0: all)")
    parser.add_argument("--output-dir", default="/tmp/loop_check", help="runs folder; its name also names the "
                        "table files in $OUT (<name>.md, <name>.json)")
    parser.add_argument("--probe-separation", type=float, default=8.0, help="the recipe's engine.probe_separation")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per run")
    parser.add_argument("--diagnose", choices=sorted(PAIRINGS), metavar="PAIRING",
                        help="instead of the check: train PAIRING here and analyse every publish (see above)")
    parser.add_argument("--prompts", type=int, default=16, help="--diagnose: probe prompts per analysis")
    parser.add_argument("--inject", choices=sorted(FAULTS), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.inject:
        return inject(args.inject, [a for a in rest if a != "--"])
    args.extra = [a for a in rest if "=" in a and not a.startswith("-")]  # key=value overrides for every run
    if len(args.extra) != len(rest):
        parser.error(f"unrecognized arguments: {[a for a in rest if a not in args.extra]}")
    if args.diagnose:
        return diagnose(args)
    pairings = [p for p in args.pairings.split(",") if p]
    unknown = [p for p in pairings if p not in PAIRINGS]
    if unknown:
        parser.error(f"--pairings: unknown {unknown}; known: {sorted(PAIRINGS)}")
    faults = [] if args.faults == "none" else [f for f in args.faults.split(",") if f]
    if any(f not in FAULTS for f in faults):
        parser.error(f"--faults: unknown {[f for f in faults if f not in FAULTS]}; known: {sorted(FAULTS)} or none")
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    rows = run_chains(args, chains(pairings, faults))
    bf16 = next((r for r in rows if r["pairing"] == "bf16" and not r["fault"] and r["kl"]), None)
    bf16_median = statistics.median(bf16["kl"]) if bf16 else None
    text = table(rows, bf16_median)
    problems = verdict(rows, args.steps, bf16_median)
    print(text)
    print("\n".join(f"FAIL: {p}" for p in problems) if problems else "loop check passed")
    out = os.environ.get("OUT")
    if out:
        stem = Path(args.output_dir).name  # loop_check by default; checks side by side keep their own files
        Path(out, f"{stem}.md").write_text(text + "\n")
        Path(out, f"{stem}.json").write_text(json.dumps(rows, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
