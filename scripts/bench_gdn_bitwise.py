"""How far Qwen3.5's gated-DeltaNet layers are from bitwise between engine and trainer, and what fp64 would change.

The trainer runs a GDN layer's scan over a whole sequence in chunks (the WY form: `chunk_gated_delta_rule`); the engine
prefills the prompt the same way and then decodes with the recurrent update, one token at a time from the carried
state (`recurrent_gated_delta_rule`). Both are the same recurrence computed in another order, so their outputs differ
in rounding. This measures, for the response tokens of prompt + response sequences with Qwen3.5-9B's head size (128)
and random inputs of the layer's ranges (L2-normed q and k, β = sigmoid, log-decay g = -softplus):

    fp32 (current)  transformers' torch chunked scan (the trainer's fallback; fla's Triton kernel on the GPU computes
                    the same form) vs the prompt's chunked prefill + recurrent decode, both in fp32, outputs in bf16
    fp64            the same two functions computing in float64, outputs rounded to bf16 once

Printed per length: the fraction of bf16 outputs that are bitwise equal and the largest |Δ| in bf16 ulps.

    python scripts/bench_gdn_bitwise.py [--prompt 64] [--responses 64 256] [--heads 4] [--seeds 2]
"""

from __future__ import annotations

import argparse
import types

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

HEAD_DIM = 128  # Qwen3.5-9B's linear_key_head_dim = linear_value_head_dim


def in_precision(fn, dtype: torch.dtype):
    """fn (a transformers GDN function, which casts its inputs to torch.float32) computing in `dtype` instead: the same
    code with `torch.float32` read as dtype."""
    fn = getattr(fn, "__wrapped__", fn)  # the torch function itself, not transformers' hub-kernel dispatcher
    shim = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    shim.float32 = dtype
    return types.FunctionType(fn.__code__, {**fn.__globals__, "torch": shim}, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def layer_inputs(tokens: int, heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, tokens, heads, HEAD_DIM, generator=g).bfloat16() for _ in range(3))
    q, k = (F.normalize(t.float(), dim=-1).bfloat16() for t in (q, k))
    beta = torch.sigmoid(torch.randn(1, tokens, heads, generator=g)).bfloat16()
    decay = -F.softplus(torch.randn(1, tokens, heads, generator=g) - 2.0)
    return q, k, v, decay, beta


def trainer_and_engine(inputs, prompt: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' outputs (bf16) of the whole-sequence chunked scan and of chunked prefill + recurrent decode."""
    chunk = in_precision(qwen35.torch_chunk_gated_delta_rule, dtype)
    recurrent = in_precision(qwen35.torch_recurrent_gated_delta_rule, dtype)
    inputs = [t.to(dtype) for t in inputs]  # exact; the functions return their inputs' dtype: rounded to bf16 here
    whole, _ = chunk(*inputs)
    head = [t[:, :prompt] for t in inputs]
    _, state = chunk(*head, output_final_state=True)
    decoded = []
    for i in range(prompt, inputs[0].shape[1]):
        out, state = recurrent(*(t[:, i:i + 1] for t in inputs), initial_state=state, output_final_state=True)
        decoded.append(out)
    return whole[:, prompt:].bfloat16(), torch.cat(decoded, dim=1).bfloat16()


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of b's bf16 spacing."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return float(((a.float() - b.float()).abs() / spacing).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--responses", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print("| response tokens | arithmetic | bitwise-equal outputs | max |Δ| (bf16 ulps) |")
    print("|---|---|---|---|")
    for response in args.responses:
        for name, dtype in (("fp32 (current)", torch.float32), ("fp64", torch.float64)):
            equal = total = 0
            worst = 0.0
            for seed in range(args.seeds):
                inputs = layer_inputs(args.prompt + response, args.heads, seed)
                trainer, engine = trainer_and_engine(inputs, args.prompt, dtype)
                equal += int((trainer.view(torch.int16) == engine.view(torch.int16)).sum())
                total += trainer.numel()
                worst = max(worst, ulps(engine, trainer))
            print(f"| {response} | {name} | {equal / total:.4%} | {worst:.1f} |", flush=True)


if __name__ == "__main__":
    main()
