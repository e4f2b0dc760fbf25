"""FP8 trainer on CUDA (Triton kernels): tiny models vs bf16, and an 8B-shaped step's memory.

Run on an H200: `bash scripts/offline/gpu_benchmarks.sh trainer` (or `pytest -m gpu tests/test_model_gpu.py`).
"""

import gc
from types import SimpleNamespace as NS

import pytest
import torch

from epirl.model import load_policy, random_policy
from epirl.model.lora import ALL_PROJECTIONS
from epirl.model.memory import activation_bytes_per_token, policy_memory_report
from model_fixtures import ProjectionCopyWatcher
from epirl.model.shapes import qwen3_8b_config
from model_fixtures import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
TARGETS = list(ALL_PROJECTIONS)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {arch: write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch)) for arch in ("qwen3", "qwen3_5", "llama")}


def make_cfg(path, base, dtype="bfloat16"):
    return NS(model=NS(path=path, dtype=dtype), seed=0,
              trainer=NS(base=base, gradient_checkpointing=True, logprob_chunk_tokens=64),
              lora=NS(rank=8, alpha=16.0, targets=TARGETS))


def train_steps(policy, steps=3, lr=1e-2, B=4, T=96):
    ids = torch.randint(0, 300, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(policy.device)
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=lr)
    losses, first_grads = [], None
    for _ in range(steps):
        logprobs, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
        loss = -logprobs.mean()
        optimizer.zero_grad()
        loss.backward()
        if first_grads is None:
            first_grads = torch.cat([p.grad.float().flatten() for p in policy.lora_parameters()])
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama"])
def test_fp8_and_bf16_bases_train_alike_on_cuda(tiny_dirs, arch):
    """As the CPU test (test_model_fp8.py), with bf16 activations and the Triton kernels. CPU bf16 measured
    gradient cosine 0.987 (Qwen3), 0.99 (Llama), 0.80 (tiny Qwen3.5, which amplifies any weight noise),
    losses within 1.2%: bounds 0.95 / 0.6 and 3%."""
    losses_fp8, g8 = train_steps(load_policy(make_cfg(tiny_dirs[arch], "fp8"), "cuda"))
    losses_bf16, g16 = train_steps(load_policy(make_cfg(tiny_dirs[arch], "bf16"), "cuda"))
    for l8, l16 in zip(losses_fp8, losses_bf16):
        assert abs(l8 - l16) < 0.03 * abs(l16), (losses_fp8, losses_bf16)
    assert losses_fp8[-1] < losses_fp8[0]
    assert torch.nn.functional.cosine_similarity(g8, g16, dim=0) > (0.6 if arch == "qwen3_5" else 0.95)


def test_triton_fp8_policy_matches_the_reference_kernels(tiny_dirs, monkeypatch):
    """CUDA Triton vs the plain-torch reference on the same codes: bf16 outputs differ by rounding only."""
    policy = load_policy(make_cfg(tiny_dirs["qwen3"], "fp8"), "cuda")
    ids = torch.randint(0, 300, (2, 65), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        triton_lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
        monkeypatch.setenv("EPIRL_KERNELS", "reference")
        reference_lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
    # bf16 rounding differs by ~1 ulp at some points (fp32 vs exact accumulation); CPU interpreter: 0.04.
    torch.testing.assert_close(triton_lp, reference_lp, rtol=0, atol=0.1)


def test_8b_fp8_step_keeps_the_base_at_fp8_size_and_never_dequantizes():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    config = qwen3_8b_config()
    policy = random_policy(config, "fp8", "cuda", rank=64, alpha=128.0, targets=TARGETS,
                           gradient_checkpointing=True)
    load_peak = torch.cuda.max_memory_allocated() - start
    report = policy_memory_report(policy)
    projection_elements = sum(m.codes.numel() for n, m in policy.model.named_modules() if hasattr(m, "codes"))
    # The base is FP8: one byte per projection weight plus one fp32 scale per fused group.
    assert report["base_projection_dtype"] == "float8_e4m3fn"
    assert projection_elements <= report["base_projection_bytes"] < projection_elements * 1.001
    static = report["base_weight_bytes"] + report["lora_param_bytes"]
    assert abs((torch.cuda.memory_allocated() - start) - static) < 64 * 2 ** 20
    # Streaming: the load peaks at the FP8 model + one packed bf16 group (gate_up, 201 MB) and temporaries.
    gate_up_bf16 = 2 * 2 * config.intermediate_size * config.hidden_size
    assert load_peak < static + 3 * gate_up_bf16, (load_peak / 2 ** 30, static / 2 ** 30)

    # One training step, 768 tokens (no activation is shaped like a 4096-or-1024-row weight).
    tokens_B_T = torch.randint(0, config.vocab_size, (2, 385), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    watcher = ProjectionCopyWatcher.for_policy(policy)
    with watcher:
        logprobs, _ = policy.token_logprobs(tokens_B_T[:, :-1], tokens_B_T[:, 1:], 1.0, 128)
        (-logprobs.mean()).backward()
    step_peak = torch.cuda.max_memory_allocated() - start
    assert watcher.hits == [], watcher.hits[:5]
    # Above the static footprint only activations, LoRA grads and one logits chunk: far below the ~14 GB a
    # 16-bit copy of the projections would take, and below a generous 3x of the activation estimate.
    activations = 768 * activation_bytes_per_token(config, gradient_checkpointing=True) + 3 * 4 * 128 * config.vocab_size
    extra = step_peak - static
    assert extra < 3 * activations + 2 * report["lora_param_bytes"], (extra / 2 ** 30, activations / 2 ** 30)
    print(f"\n8B fp8: base {report['base_weight_bytes'] / 2**30:.2f} GiB, load peak {load_peak / 2**30:.2f} GiB, "
          f"step peak {step_peak / 2**30:.2f} GiB (activation estimate {activations / 2**30:.2f} GiB)")


def test_same_device_treats_cuda_and_cuda0_alike():
    """The engine's tensors live on `cuda:0`, the trainer asks for `cuda`: torch.device compares fields,
    and a plain `!=` made `trainer.base: shared` silently load its own embeddings (seen on an H200)."""
    from epirl.model.loading import same_device

    assert same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert same_device(torch.zeros(1, device="cuda").device, torch.device("cuda"))
    assert not same_device(torch.device("cuda:0"), torch.device("cpu"))
