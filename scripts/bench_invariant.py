"""Benchmark the bitwise pairing's invariant kernels (`epirl.kernels.invariant`, Triton) against what the matched
pairing runs in their place, side by side in one process; prints one markdown table, writes JSON.

Rows (Qwen3-8B shape by default: 32 / 8 heads of 128, hidden 4096, intermediate 12288, vocabulary 151,936):
  attention fwd      attention_batched, B × T causal, vs torch SDPA (is_causal, enable_gqa)
  attention fwd+bwd  the trainer's (Triton forward, backward through SDPA recomputed) vs SDPA forward + backward
  decode attention   paged_attention, R requests × L keys, block size 16: GB/s of keys and values read
  LM head            logits at N rows vs F.linear in bf16 (cuBLAS) cast to fp32, and the weight-read floor
  log-softmax        log_softmax of fp32 [N, V] vs torch.log_softmax
  rms_norm + residual, silu_mul  vs their fp32 torch formulas (eager)
Timing: CUDA-graph replays with an L2 flush before each call (epirl.kernels.gpu_timing.graph_us); fwd+bwd rows with
triton.testing.do_bench.
Usage: python scripts/bench_invariant.py [--json PATH] [--hbm-tbs 3.35]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from epirl.kernels import invariant
from epirl.kernels.gpu_timing import flush_mode, graph_us

SHAPE = dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=12288, vocab=151936)
bench_us = graph_us  # the CPU test replaces the clocks
step_us = lambda fn: do_bench(fn) * 1e3  # noqa: E731


def _row(op: str, shape: str, ours: float, other_name: str, other: float | None, note: str = "") -> dict:
    return dict(op=op, shape=shape, invariant_us=ours, other=other_name, other_us=other,
                ratio=None if not other else ours / other, note=note)


def attention_rows(B: int, T: int, dev: str) -> list[dict]:
    H, G, D = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    q, k, v = (torch.randn(B, T, n, D, device=dev).bfloat16() for n in (H, G, G))
    scale = D ** -0.5

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)

    shape = f"B {B} × T {T}, {H}/{G} heads of {D}"
    rows = [_row("attention fwd", shape, bench_us(lambda: invariant.attention_batched(q, k, v, scale)), "SDPA",
                 bench_us(lambda: sdpa(q, k, v)))]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)

    def step(fn):
        return lambda: torch.autograd.backward(fn(*leaves), grad)
    rows.append(_row("attention fwd+bwd", shape, step_us(step(lambda q, k, v: invariant.attention_batched(
        q, k, v, scale))), "SDPA", step_us(step(sdpa))))
    return rows


def decode_row(R: int, L: int, dev: str, hbm_tbs: float) -> dict:
    H, G, D, bs = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"], 16
    k_store, v_store = (torch.randn(R * L, G, D, device=dev).bfloat16() for _ in range(2))
    table = torch.randperm(R * L // bs, device=dev).to(torch.int32).view(R, L // bs)
    q = torch.randn(R, H, D, device=dev).bfloat16()
    qsl = torch.arange(R + 1, dtype=torch.int32, device=dev)
    lens = torch.full((R,), L, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    us = bench_us(lambda: invariant.paged_attention(q, k_store, v_store, table, bs, qsl, lens, 1, D ** -0.5,
                                                    out=out))
    read = 2 * R * L * G * D * 2
    return _row("decode attention", f"{R} requests × {L} keys, block 16", us, "read floor", read / hbm_tbs / 1e6,
                f"{read / us / 1e3:.0f} GB/s")


def head_rows(rows_n: list[int], dev: str, hbm_tbs: float) -> list[dict]:
    V, Hd = SHAPE["vocab"], SHAPE["hidden"]
    weight = (torch.randn(V, Hd, device=dev) * 0.02).bfloat16()
    out = []
    for n in rows_n:
        h = torch.randn(n, Hd, device=dev).bfloat16()
        floor = V * Hd * 2 / hbm_tbs / 1e6
        out.append(_row("LM head", f"{n} × {Hd} · {V} × {Hd}", bench_us(lambda: invariant.logits(h, weight)),
                        "F.linear bf16", bench_us(lambda: F.linear(h, weight).float()), f"read floor {floor:.0f} µs"))
        x = torch.randn(n, V, device=dev) * 3
        out.append(_row("log-softmax", f"{n} × {V}", bench_us(lambda: invariant.log_softmax(x)), "torch",
                        bench_us(lambda: torch.log_softmax(x, dim=-1))))
    return out


def row_op_rows(n: int, dev: str) -> list[dict]:
    Hd, I = SHAPE["hidden"], SHAPE["intermediate"]
    x, r = (torch.randn(n, Hd, device=dev).bfloat16() for _ in range(2))
    w = torch.ones(Hd, device=dev).bfloat16()
    gu = torch.randn(n, 2 * I, device=dev).bfloat16()

    def norm_fp32():
        s = (x.float() + r.float()).bfloat16().float()
        return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    return [_row("rms_norm + residual", f"{n} × {Hd}", bench_us(lambda: invariant.rms_norm(x, w, 1e-6, r)),
                 "torch fp32", bench_us(norm_fp32)),
            _row("silu_mul", f"{n} × {I}", bench_us(lambda: invariant.silu_mul(gu[:, :I], gu[:, I:])), "torch fp32",
                 bench_us(lambda: (F.silu(gu[:, :I].float()) * gu[:, I:].float()).bfloat16()))]


def print_table(rows: list[dict]) -> None:
    print("| op | shape | invariant µs | instead | µs | ratio | note |\n|---|---|---|---|---|---|---|")
    for r in rows:
        other = "–" if r["other_us"] is None else f"{r['other_us']:.1f}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        print(f"| {r['op']} | {r['shape']} | {r['invariant_us']:.1f} | {r['other']} | {other} | {ratio} | {r['note']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth for the floors (H100 SXM: 3.35)")
    args = parser.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    rows = [*attention_rows(8, 1024, dev), decode_row(32, 1024, dev, args.hbm_tbs),
            *head_rows([1, 32, 4096], dev, args.hbm_tbs), *row_op_rows(64, dev), *row_op_rows(4096, dev)]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, L2 flush: {flush_mode()}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
