"""Checks, on an H200, that the staged Triton 3.7.1 + flash-linear-attention kit (scripts/offline/triton_kit.sh)
is the one imported and that everything epirl runs on Triton still works with it; prints one markdown table.

    source scripts/offline/device_env.sh && source ~/env-triton37.sh
    python3 -P scripts/offline/gpu_fla_check.py [--skip-vllm]

Rows: versions + paths (proves which triton is imported); fla's chunk_gated_delta_rule forward + backward vs
transformers' torch reference on odd shapes; epirl's `select_gdn_kernel` verdict and a tiny random Qwen3.5's
logits/gradients with fla vs the torch path; torch.compile (inductor's Triton codegen); epirl's own Triton kernels
through the GPU tests' own assertions; a tiny vLLM Qwen3.5 engine (CUDA graphs, Triton GDN prefill) when vLLM
imports. Every check runs in its own try/except: one failure shows as one row and never hides the others. Exit
status 1 when a required check failed. Budget several minutes on a fresh machine: the fla-vs-torch check alone
took over 145 s there (fla autotunes and compiles every kernel at each new shape on first use). Nothing CUDA is
imported at module import (tests/test_triton_kit.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python3 -P` drops the cwd; epirl itself comes from device_env.sh's PYTHONPATH
    sys.path.append(str(ROOT))


class Skip(Exception):
    """Raised by a check that does not apply here (e.g. vLLM not importable): shown as skipped, never as passed."""


@dataclass
class Check:
    name: str
    fn: Callable[[], str]  # returns a one-line detail; raises on failure (AssertionError or anything else)
    required: bool = True


@dataclass
class Result:
    name: str
    status: str  # "ok" | "FAIL" | "skip"
    detail: str
    seconds: float
    required: bool


def run_checks(checks: list[Check]) -> list[Result]:
    results = []
    for check in checks:
        t0 = time.perf_counter()
        try:
            status, detail = "ok", check.fn()
        except Skip as exc:
            status, detail = "skip", str(exc)
        except BaseException as exc:  # noqa: BLE001 - one row per failure; KeyboardInterrupt still stops below
            if isinstance(exc, KeyboardInterrupt):
                raise
            lines = str(exc).strip().splitlines()
            status, detail = "FAIL", f"{type(exc).__name__}: {lines[0] if lines else ''}"
        results.append(Result(check.name, status, " ".join(str(detail).split())[:300],
                              time.perf_counter() - t0, check.required))
        print(f"[{results[-1].status}] {check.name} ({results[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    return results


def format_table(results: list[Result]) -> str:
    rows = ["| check | result | s | detail |", "|---|---|---|---|"]
    for r in results:
        flag = r.status if r.required or r.status != "FAIL" else "FAIL (optional)"
        rows.append(f"| {r.name} | {flag} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |")
    return "\n".join(rows)


def exit_code(results: list[Result]) -> int:
    return int(any(r.status == "FAIL" and r.required for r in results))


def _load_by_path(name: str, path: Path):
    """Import a file of tests/ by path: `tests` is no package, and a site-packages `tests` must not shadow it. Its
    folder goes on sys.path, as pytest puts it there, for the helpers it imports (tests/kernels/gpu_problem.py)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rel(got, want) -> tuple[float, float]:
    """(‖got − want‖ / ‖want‖, max |got − want|) in float64; NaN anywhere fails."""
    got, want = got.double(), want.double()
    assert not got.isnan().any(), "NaN in the fla result"
    diff = got - want
    return (diff.norm() / want.norm().clamp_min(1e-30)).item(), diff.abs().max().item()


# ---- the checks ---------------------------------------------------------------------------------------------

def check_versions(expect_triton: str) -> str:
    import importlib.metadata as md

    import torch
    import triton

    import fla

    where = os.path.dirname(os.path.dirname(triton.__file__))
    assert triton.__version__ == expect_triton, f"triton {triton.__version__} imported from {where}"
    assert md.version("triton") == triton.__version__, f"dist-info says {md.version('triton')}: two tritons mixed"
    from torch.utils._triton import has_triton

    assert has_triton(), "torch.utils._triton.has_triton() is False with this triton"
    return (f"torch {torch.__version__} ({torch.version.cuda}); triton {triton.__version__} from {where}; "
            f"fla {md.version('flash-linear-attention')} from {os.path.dirname(fla.__file__)}; "
            f"GPU {torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}")


def _gdn_inputs(B, T, H, K, V, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda", generator=g)
    q, k = (torch.randn(B, T, H, K, **dev).bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, V, **dev).bfloat16()
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, **dev)) / 4  # log decay in (-inf, 0), as Qwen3.5's
    beta = torch.rand(B, T, H, **dev).sigmoid().bfloat16()
    h0 = torch.randn(B, H, K, V, **dev) * 0.1
    return [q, k, v, gate, beta, h0]


def _torch_reference(fn):
    """transformers' own torch GDN under its hub wrapper (which dispatches to fla once fla imports): without it the
    comparison would be fla against fla and pass vacuously, so its absence fails the check."""
    raw = getattr(fn, "__wrapped__", None)
    assert raw is not None and not raw.__module__.startswith("fla"), f"no torch reference under {fn!r}"
    return raw


GDN_TOL = {"o": 1e-2, "ht": 1e-2, "grad": 2e-2}  # ‖Δ‖/‖ref‖: bf16 operands land at 1e-3..1e-2 (METHOD.md)


def check_gdn_vs_torch() -> str:
    """fla (bf16 in, fp32 state) vs transformers' torch reference (fp32 from the same bf16 values): output,
    final state and the gradients of q, k, v, g, beta, h0 under a random cotangent; T not a multiple of 64."""
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as qmod

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    reference = _torch_reference(qmod.torch_chunk_gated_delta_rule)
    worst = {}
    for B, T, H, K, V in [(2, 137, 3, 128, 128), (1, 67, 2, 64, 64)]:
        inputs = _gdn_inputs(B, T, H, K, V, seed=T)
        outs = {}
        for name, fn, cast in (("fla", chunk_gated_delta_rule, lambda x: x), ("ref", reference, lambda x: x.float())):
            leaves = [cast(x).detach().requires_grad_() for x in inputs]
            q, k, v, gate, beta, h0 = leaves
            o, ht = fn(q, k, v, g=gate, beta=beta, initial_state=h0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
            gen = torch.Generator(device="cuda").manual_seed(1)
            do, dht = torch.randn(o.shape, device="cuda", generator=gen), torch.randn(ht.shape, device="cuda", generator=gen)
            ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
            outs[name] = [o.detach(), ht.detach()] + [x.grad for x in leaves]
        labels = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
        for label, got, want in zip(labels, outs["fla"], outs["ref"]):
            assert got is not None, f"fla gave no gradient for {label}"
            rel, amax = _rel(got, want)
            tol = GDN_TOL.get(label, GDN_TOL["grad"])
            assert rel <= tol, f"{label} at B,T,H,K={B},{T},{H},{K}: rel {rel:.2e} > {tol:g} (max |Δ| {amax:.3g})"
            worst[label] = max(worst.get(label, (0, 0)), (rel, amax))
    parts = [f"{k} {r:.1e}/{a:.2g}" for k, (r, a) in worst.items()]
    return "rel, max abs diff (tol rel: o, ht 1e-2; grads 2e-2): " + ", ".join(parts)


def _tiny_qwen35():
    import torch
    from transformers import AutoModelForCausalLM

    fixtures = _load_by_path("epirl_test_model_fixtures", ROOT / "tests" / "model_fixtures.py")
    config = fixtures.tiny_config("qwen3_5", vocab_size=384, eos_token_id=2, pad_token_id=0)
    config.linear_key_head_dim = config.linear_value_head_dim = 64  # Qwen3.5 uses 128; 16 is below fla's tiles
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fixtures._spread_weights(model, 0)  # HF's std 0.02 makes a near-constant function: the comparison would pass vacuously
    return model.to("cuda", torch.bfloat16)


def check_select_gdn_kernel() -> str:
    """epirl's verdict on this device must be 'fla'; then the same tiny model's loss gradient with fla vs with
    the torch path (the switch select_gdn_kernel makes on failure)."""
    import torch

    from epirl.model import linear_attention as la

    model = _tiny_qwen35()
    verdict = la.select_gdn_kernel(model, torch.device("cuda"))
    assert verdict == "fla", f"select_gdn_kernel: {verdict}"
    ids = torch.randint(3, 384, (2, 150), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])

    loss_fla, grads_fla = loss_and_grads()
    module = sys.modules[type(la._gdn_layers(model)[0]).__module__]
    saved = getattr(module, la.GLOBAL_NAME)
    _torch_reference(saved)  # the torch path below must really be torch, not fla again
    setattr(module, la.GLOBAL_NAME, la._torch_path(saved))  # transformers >= 5: the layers call this global
    try:
        loss_ref, grads_ref = loss_and_grads()
    finally:
        setattr(module, la.GLOBAL_NAME, saved)
    rel, amax = _rel(grads_fla, grads_ref)
    assert torch.isfinite(loss_fla) and abs(loss_fla - loss_ref) <= 2e-2 * abs(loss_ref), (loss_fla, loss_ref)
    assert rel <= 5e-2, f"parameter gradients fla vs torch: rel {rel:.2e} (max |Δ| {amax:.3g})"
    return f"verdict fla; loss {loss_fla:.4f} vs torch {loss_ref:.4f}; all grads rel {rel:.1e} (tol 5e-2, bf16 model)"


def check_torch_compile() -> str:
    """Inductor generates and runs Triton (forward and backward) with this triton; fp32 result vs eager."""
    import torch
    from torch._inductor.utils import run_and_get_code

    def f(x, w):
        return (torch.nn.functional.gelu(x * w + x.pow(2)).softmax(-1) * x.sin()).sum(-1)

    x = torch.randn(257, 1000, device="cuda", requires_grad=True)
    w = torch.randn(1000, device="cuda", requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)

    def step(fn):
        x.grad = None
        y = fn(x, w)
        y.sum().backward()  # inductor compiles the backward graph here, inside run_and_get_code
        return y.detach(), x.grad.clone()

    (out, gx), codes = run_and_get_code(lambda: step(compiled))
    assert any("@triton.jit" in c for c in codes), "inductor produced no Triton kernel"
    want, gx_want = step(f)
    rel_o, _ = _rel(out, want)
    rel_g, _ = _rel(gx, gx_want)
    assert rel_o < 1e-5 and rel_g < 1e-5, f"compiled vs eager: out rel {rel_o:.1e}, dx rel {rel_g:.1e}"
    return f"{sum(c.count('@triton.jit') for c in codes)} Triton kernels; vs eager rel out {rel_o:.0e}, dx {rel_g:.0e}"


def check_compile_user_kernel() -> str:
    """torch.compile (dynamic shapes) around a user @triton.jit kernel that writes its input in place and takes
    scalars: the triton_kernel_wrapper path that later torch releases adapted to Triton 3.7 (ordered_arg_names
    then include scalars such as SymInts). epirl's and vLLM's kernels enter compiled graphs as custom ops, not
    this way, so the row is optional: a failure here is a limit to know, not a broken run."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def axpy_(x_ptr, y_ptr, alpha, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, y + alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)

    def f(x, y, alpha):
        y = y.clone()
        axpy_[(triton.cdiv(x.numel(), 256),)](x, y, alpha, x.numel(), BLOCK=256)
        return y * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    worst = 0.0
    for n in (1000, 1537):
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        worst = max(worst, _rel(compiled(x, y, 0.5), (y + 0.5 * x) * 2)[0])
    assert worst < 1e-6, f"rel {worst:.1e}"
    return f"in-place user kernel, 2 sizes under one dynamic graph: rel {worst:.0e}"


def check_epirl_kernels() -> str:
    """epirl's Triton kernels through the GPU tests' own assertions (bit-exact quantization and split-K, W8A16/
    W8A8 within 2 bf16 ulps of the reference, batch invariance)."""
    t = _load_by_path("epirl_test_gpu_kernels", ROOT / "tests" / "kernels" / "test_gpu_kernels.py")
    runs = [
        ("per-token quant bitwise", lambda: t.test_per_token_quant_bit_exact(17, 12288)),
        ("weight/per-tensor quant bitwise", lambda: t.test_weight_and_per_tensor_quant_bit_exact((1304, 1000))),
        ("w8a16 vs ref", lambda: t.test_w8a16_lora_vs_reference(17, 16)),
        ("w8a8 vs ref", lambda: t.test_w8a8_lora_vs_reference(257)),
        ("split-K bitwise", lambda: t.test_split_k_decode_path_equals_single_pass_bitwise(t.K_ODD, t.N_ODD)),
        ("NaN out fully written", lambda: t.test_gemms_write_every_element_of_a_nan_out(3)),
    ]
    failed = []
    for label, fn in runs:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - collect all, fail once with the list
            failed.append(f"{label}: {type(exc).__name__} {str(exc).splitlines()[0][:80] if str(exc) else ''}")
    assert not failed, "; ".join(failed)
    return ", ".join(label for label, _ in runs)


def _tiny_vllm_qwen35(folder: Path) -> Path:
    """The shipped Qwen3.5-9B config (full form: text + vision, as vLLM wants) shrunk to 4 layers."""
    import json

    config = json.loads((ROOT / "recipes" / "configs" / "Qwen3.5-9B" / "config.json").read_text())
    text = config["text_config"]
    text.update(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, layer_types=text["layer_types"][:4],
                num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=4096)  # the real vocabulary: image/video token ids stay inside it
    config["vision_config"]["out_hidden_size"] = 512
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def check_vllm(skip: bool) -> str:
    """A tiny Qwen3.5 engine with CUDA graphs + torch.compile and the Triton GDN prefill (FlashInfer is not
    shipped): greedy generation of a few tokens from a 150-token prompt (prefill > one 64-token chunk)."""
    if skip:
        raise Skip("--skip-vllm")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm not importable (the vLLM kit is not staged)")
    from vllm import LLM, SamplingParams

    folder = _tiny_vllm_qwen35(Path(tempfile.mkdtemp(prefix="q35tiny_")))
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, language_model_only=True,
              gdn_prefill_backend="triton", enforce_eager=False, gpu_memory_utilization=0.25, max_model_len=512,
              max_num_seqs=4, dtype="bfloat16", seed=0)
    start = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": list(range(10, 160))}, {"prompt_token_ids": list(range(300, 330))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == 8 for t in tokens), tokens
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == tokens, f"greedy decoding not reproducible: {tokens} vs {again}"
    del llm
    return f"engine up in {start:.0f} s (compile + CUDA graphs); greedy 2x8 tokens, reproducible: {tokens[0][:4]}..."


def build_checks(args) -> list[Check]:
    return [
        Check("versions / paths", lambda: check_versions(args.expect_triton)),
        Check("fla GDN fwd+bwd vs torch ref", check_gdn_vs_torch),
        Check("select_gdn_kernel + tiny Qwen3.5 grads", check_select_gdn_kernel),
        Check("torch.compile (inductor Triton)", check_torch_compile),
        Check("torch.compile + user Triton kernel", check_compile_user_kernel, required=False),
        Check("epirl Triton kernels", check_epirl_kernels),
        Check("vLLM tiny Qwen3.5 (graphs, triton GDN)", lambda: check_vllm(args.skip_vllm)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-vllm", action="store_true", help="do not start the tiny vLLM engine")
    parser.add_argument("--expect-triton", default="3.7.1",
                        help="the triton version that must be imported (3.6.0: check the image without the kit)")
    args = parser.parse_args(argv)
    results = run_checks(build_checks(args))
    print(format_table(results))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
