"""GPU tests: a decoder's W8A16 + LoRA calls replayed from CUDA graphs give the eager run's bits, as the matched
engine runs them under vLLM (graphs per batch size captured on a fresh side stream into one shared memory pool,
largest first, no warmup on that stream; then replays in any order with new inputs). Both forms of the fused layers:
q, k, v as one block-diagonal call (`kernels.fused_slices`) and one call per slice into the columns of one output. The kernels let the
base GEMM run beside its down-projection (PDL), which the caching allocator does not see: a workspace it frees while a
kernel still reads it shows up here as wrong or non-finite rows."""

import pytest
import torch

from epirl.kernels import quantize_weight_fp8, w8a16_lora
from epirl.kernels import plan as kplan
from epirl.kernels.w8a16 import ws_splitk
from epirl.kernels.w8a16.slices import per_slice_call, sliced_lora_operands

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV, SIGMA = "cuda", 2.0
HIDDEN, HEADS_QKV, INTER, RANK, LAYERS = 576, [576, 192, 192], 1536, 16, 4  # SmolLM2-135M's shapes
BATCHES = [64, 32, 16, 8, 4, 2, 1]  # captured largest first, as vLLM does


def _linear(widths, k, g):
    codes, scale = quantize_weight_fp8([torch.randn(w, k, generator=g, device=DEV) * 0.05 for w in widths])
    a = [(torch.randn(RANK, k, generator=g, device=DEV) / k ** 0.5).bfloat16() for _ in widths]
    b = [(torch.randn(w, RANK, generator=g, device=DEV) * 0.05).bfloat16() for w in widths]
    a_cat, b_bd = sliced_lora_operands(a, b, widths, torch.bfloat16)
    return dict(codes=codes, scale=scale, a=a, b=b, widths=widths, a_cat=a_cat, b_bd=b_bd)


def _call(x, lin, fused):
    if len(lin["widths"]) == 1:
        return w8a16_lora(x, lin["codes"], lin["scale"], lin["a"][0], lin["b"][0], SIGMA)
    if fused:
        return w8a16_lora(x, lin["codes"], lin["scale"], lin["a_cat"], lin["b_bd"], SIGMA)
    return per_slice_call(x, lin["codes"], lin["scale"], lin["a"], lin["b"], lin["widths"], SIGMA)


def _norm(h):
    return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()


def decoder(x, layers, fused_qkv):
    """A Llama decoder's linear layers with cheap stand-ins for attention (gate up is per slice in both forms, as the
    engine runs it)."""
    h = x
    q_n, kv_n = HEADS_QKV[0], HEADS_QKV[1]
    for layer in layers:
        qkv = _call(_norm(h), layer["qkv"], fused_qkv)
        q, k, v = qkv.split(HEADS_QKV, dim=-1)
        mixed = q * torch.sigmoid(k.repeat(1, q_n // kv_n)) + v.repeat(1, q_n // kv_n)
        h = h + _call(mixed, layer["o"], True)
        gate_up = _call(_norm(h), layer["gate_up"], False)
        act = torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        h = h + _call(act, layer["down"], True)
    return h


@pytest.fixture(scope="module")
def layers():
    g = torch.Generator(device=DEV).manual_seed(5)
    return [dict(qkv=_linear(HEADS_QKV, HIDDEN, g), o=_linear([HIDDEN], HIDDEN, g),
                 gate_up=_linear([INTER, INTER], HIDDEN, g), down=_linear([HIDDEN], INTER, g))
            for _ in range(LAYERS)]


def _poisoned_pool():
    """A graph memory pool whose free blocks hold non-zero bytes: what a pool holds after earlier graphs' replays
    (vLLM's capture pool after its memory-profiling captures). A workspace made inside a capture takes such a block,
    and its captured memset runs only when its own graph replays."""
    pool, graph = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        junk = torch.empty(64 << 20, dtype=torch.int32, device=DEV)
        junk.fill_(0x01010101)
    graph.replay()
    torch.cuda.synchronize()
    del junk  # its block goes back to the pool, filled
    return pool, graph


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "first-use-in-capture"])
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["fused-slices", "per-slice"])
def test_graph_replays_give_the_eager_bits(layers, fused_qkv, reserved):
    """As vLLM captures: kernels compiled by eager runs on another stream, graphs captured on a fresh stream with no
    warmup there, into a pool that already held data. reserved: the counter workspaces made beforehand (as the serving
    plugin does); first-use-in-capture: none made, so each captured call zeroes its own."""
    assert kplan.describe(torch.device(DEV)).pdl or torch.cuda.get_device_capability()[0] < 9, "PDL off on Hopper"
    inputs = {m: torch.zeros(m, HIDDEN, device=DEV, dtype=torch.bfloat16) for m in BATCHES}
    for m in BATCHES:
        decoder(inputs[m], layers, fused_qkv)  # compiles, on the default stream
    torch.cuda.synchronize()
    ws_splitk._COUNTERS.clear()
    if reserved:
        ws_splitk.reserve_counters(DEV)
    (pool, _poison), stream = _poisoned_pool(), torch.cuda.Stream()
    graphs, outputs = {}, {}
    with torch.cuda.stream(stream):
        for m in BATCHES:
            graphs[m] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[m], pool=pool, stream=stream):
                outputs[m] = decoder(inputs[m], layers, fused_qkv)
    here = torch.device(DEV, torch.cuda.current_device())
    assert set(ws_splitk._COUNTERS) == ({(here, role) for role in ws_splitk.ROLES} if reserved else set())
    torch.cuda.synchronize()
    g = torch.Generator(device=DEV).manual_seed(11)
    for step in range(3):
        for m in (1, 64, 4, 2, 32, 8, 16, 1, 64):
            inputs[m].copy_(torch.randn(m, HIDDEN, generator=g, device=DEV))
            graphs[m].replay()
            want = decoder(inputs[m], layers, fused_qkv)
            torch.cuda.synchronize()
            got = outputs[m]
            assert bool(torch.isfinite(got).all()), (step, m, int((~torch.isfinite(got)).sum()))
            assert torch.equal(got, want), (step, m, float((got.float() - want.float()).abs().max()))
