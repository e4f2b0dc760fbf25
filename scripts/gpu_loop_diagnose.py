"""Where the engine and the trainer part ways under a *trained* adapter: the SmolLM2 recipe on the GPU, a few steps,
then after every publish the probe's tokens scored against every reference the probe could use.

    source scripts/offline/device_env.sh && python3 -P scripts/gpu_loop_diagnose.py --pairing w8a16 --steps 6 --eager

Per step (after the publish): the engine samples the probe prompts (decode log-probs `e`), re-scores them itself
(prefill, under the new adapter, the previous one re-published, and none), and the trainer scores them under new / old /
base, under the new step amplified (old + k (new - old)), and with FP8 activations (variant c) where it has FP8
projections. Printed: the arrival fraction β of `e` against each reference pair, and how much of the trainer's own
one-step separation another arithmetic reproduces (the reliability of δ: 1 = the step's effect on the log-probs is the
same in both arithmetics, small = rounding flips dominate it). For the matched engine (eager) it also checks every LoRA
layer: the engine's adapter buffers equal the trainer's parameters, and a captured decode call equals the trainer's
module on the same input, bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_loop_check import PAIRINGS  # noqa: E402  (one definition of the pairings for both scripts)

ROWS: list[dict] = []


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
    return torch.tensor([v for row in lists for v in row], dtype=torch.float32)


def analyze(probe, engine, policy, previous, step):
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
    report(row, e, quantized)


def report(row, e, quantized):
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
    ROWS.append(out)
    print("DIAG " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairing", choices=sorted(PAIRINGS), default="w8a16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="eager engine (the layer check needs it)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from epirl.config import load_config
    from epirl.rl import loop
    from epirl.rl.probe import PublishProbe

    overrides = [f"name=diag_{args.pairing}", "output_dir=/tmp/diag", "tracking.wandb=disabled",
                 "engine.gpu_memory_utilization=0.25", f"engine.enforce_eager={str(args.eager).lower()}",
                 "checkpoint.every=0", f"engine.probe_prompts={args.prompts}", f"rl.steps={args.steps}",
                 *PAIRINGS[args.pairing], *args.overrides]
    cfg = load_config("recipes/smollm2_arith_cpu.yaml", overrides)
    original = PublishProbe.__call__

    def probe_call(self, engine, policy, previous, step):
        self.enforce = False
        metrics = original(self, engine, policy, previous, step)
        print(f"PROBE step {step}: " + json.dumps({k: round(v, 4) for k, v in metrics.items()}), flush=True)
        analyze(self, engine, policy, previous, step)
        return metrics

    PublishProbe.__call__ = probe_call
    import shutil

    shutil.rmtree(f"/tmp/diag/diag_{args.pairing}", ignore_errors=True)
    run_dir = loop.train(cfg)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        print(f"STEP {m['step']}: acc {m.get('reward/accuracy', float('nan')):.3f} "
              f"kl {m.get('mismatch/k3_kl', float('nan')):.3e}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"diag_{args.pairing}.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
