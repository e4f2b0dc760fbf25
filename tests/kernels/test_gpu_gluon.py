"""GPU tests of the warp-specialized Gluon training GEMM (kernels/w8a16/ws_gluon.py): every form of it - the table's
configs, the LoRA ring, the persistent kernel, the codes widened in shared memory, dX - gives the pointer kernel's
bits."""

import pytest
import torch

from epirl.kernels.w8a16.weight_stationary import lora_down, weight_stationary_gemm

from gpu_problem import DEV, problem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("K,N", [(4096, 4096), (12288, 4096), (4096, 12288)])
def test_gluon_forward_gives_the_pointer_kernels_bits(K, N):
    """The warp-specialized Gluon forward (kernels/w8a16/ws_gluon.py, a table entry's "gluon") gives the pointer
    kernel's bits: rank 64 with bias, rank 16 without, no LoRA, at token counts that fill its 256-token tiles and
    that leave the last one ragged (257, 4113), into a NaN-filled output; through the table (checked against the
    pointer kernel per key) and with the entry as an explicit config (the kernel as it is), each called twice (its
    first version raced: wrong values that changed from run to run)."""
    from epirl.kernels.w8a16 import weight_stationary as ws
    from epirl.kernels.w8a16.configs import k_chunking, ws_config
    x, codes, scale, a, b, bias = problem(4113, K, N, 64, seed=K + 2 * N)
    table_cfg = dict(ws_config("fwd", N, K, 4096))
    assert "gluon" in table_cfg, (K, N)
    pointer = {k: v for k, v in table_cfg.items() if k not in ("gluon", "tma")}
    k_chunk, n_chunks = k_chunking(N, K)
    for M in (257, 4113):
        xs = x[:M]
        for r, with_bias in ((64, True), (16, False), (0, True)):
            lora = dict(xa=lora_down(xs, a[:r], chunk_n=N), lora_b=b[:, :r].contiguous(), lora_scale=2.0) if r else {}
            args = dict(w_scale=scale, bias=bias if with_bias else None, **lora)
            assert ws._gluon().gluon_ok(xs, codes, torch.empty(M, N, device=DEV), lora.get("xa"), lora.get("lora_b"),
                                        k_chunk, n_chunks, table_cfg["gluon"], max(16, r) if r else 16)
            want = weight_stationary_gemm(xs, codes, torch.bfloat16, config=pointer, **args)
            for cfg in (None, table_cfg, None, table_cfg):
                out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                got = weight_stationary_gemm(xs, codes, torch.bfloat16, config=cfg, out=out, **args)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (K, N, M, r, cfg is None)
    assert "broken" not in ws._GLUON, ws._GLUON


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("op", ["fwd", "dx"])
def test_gluon_lora_ring_gives_the_pointer_kernels_bits(op, persistent):
    """A config with "LORA_RING" streams the LoRA ranks through the k-step ring (`ws_gluon._lora_ring`): at the fused
    qkv's rank 192 (256 padded; the LoRA tiles would overflow shared memory at 256 tokens) it runs at the entry's
    256-token tiles, and at rank 64 too, with the pointer kernel's bits; at rank 16 (not whole 64-rank steps) the
    tiles path runs instead, same bits. With "PERSISTENT" (`runs_persistent`: a program per SM over many tiles, one
    ring through them) the same bits, also without a LoRA; at rank 16 it runs the one-tile kernel. Ragged last token
    tile, NaN-filled output, each call twice."""
    from epirl.kernels.w8a16 import weight_stationary as ws
    from epirl.kernels.w8a16.configs import k_chunking, ws_config
    K, N, M = 4096, 6144, 4113
    x, codes, scale, a, b, bias = problem(M, K, N, 192, seed=13)
    gy = torch.randn(M, N, device=DEV).bfloat16()
    table_cfg = dict(ws_config(op, N if op == "fwd" else K, K if op == "fwd" else N, 4096))
    ring = dict(table_cfg["gluon"], LORA_RING=True, PERSISTENT=persistent)
    gluon = ws._gluon()
    for r in (192, 64, 16, 0):
        br = ws._epilogue_rows(r)
        if op == "fwd":
            xs, w, n_out, (k_chunk, n_chunks) = x, codes, N, k_chunking(N, K)
            args = dict(xa=lora_down(x, a[:r], chunk_n=N), lora_b=b[:, :r].contiguous(), bias=bias)
        else:
            xs, w, n_out, (k_chunk, n_chunks) = gy, codes.t(), K, ws.whole_k(N)
            args = dict(xa=(gy @ b[:, :r]).bfloat16(), lora_b=a[:r].t())
        if r == 0:
            args.update(xa=None, lora_b=None)
        args.update(w_scale=scale, lora_scale=2.0, op=op)
        y = torch.empty(M, n_out, device=DEV, dtype=torch.bfloat16)
        assert gluon.lora_through_ring(ring, args["xa"], br) == (r in (64, 192))
        assert gluon.runs_persistent(ring, args["xa"], br, n_chunks * k_chunk // 64) == (persistent and r != 16)
        assert gluon.fitting_config(xs, w, y, args["xa"], args["lora_b"], k_chunk, n_chunks, ring, br) == ring, r
        pointer = dict({k: v for k, v in table_cfg.items() if k not in ("gluon", "tma")}, tma=False)
        want = weight_stationary_gemm(xs, w, torch.bfloat16, config=pointer, **args)
        for _ in range(2):
            out = torch.full((M, n_out), float("nan"), device=DEV, dtype=torch.bfloat16)
            got = weight_stationary_gemm(xs, w, torch.bfloat16, config=dict(table_cfg, gluon=ring), out=out, **args)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (op, r, persistent)
    assert "broken" not in ws._GLUON, ws._GLUON


def test_gluon_forward_narrows_its_tile_for_the_fused_qkv_rank():
    """At rank 192 (a fused qkv's block-diagonal rank, 256 in the epilogue) 256-token tiles with the LoRA tiles
    resident overflow shared memory; `fitting_config` runs 128-token tiles instead, with the pointer kernel's bits.
    With LORA_RING the ranks stream through the k-step ring and the 256-token tile fits as it is (forward and dX).
    The table's own entry (whichever of these it holds) gives the same bits, twice. Explicit configs: the test
    must not depend on what the tuner last picked."""
    from epirl.kernels.w8a16 import weight_stationary as ws
    from epirl.kernels.w8a16.configs import k_chunking, ws_config
    K, N, M = 4096, 4096, 4113
    x, codes, scale, a, b, bias = problem(M, K, N, 192, seed=11)
    table_cfg = dict(ws_config("fwd", N, K, 4096))
    pointer = {k: v for k, v in table_cfg.items() if k not in ("gluon", "tma")}
    resident = {"BM": 256, "BK": 64, "num_stages": 4, "GROUP_N": 16}
    ring = dict(resident, LORA_RING=True)
    k_chunk, n_chunks = k_chunking(N, K)
    xa = lora_down(x, a, chunk_n=N)
    y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    gluon = ws._gluon()
    assert not gluon.gluon_ok(x, codes, y, xa, b, k_chunk, n_chunks, resident, 256)
    narrow = gluon.fitting_config(x, codes, y, xa, b, k_chunk, n_chunks, resident, 256)
    assert narrow == dict(resident, BM=128)
    assert gluon.fitting_config(x, codes, y, xa, b, k_chunk, n_chunks, ring, 256) == ring
    args = dict(w_scale=scale, bias=bias, xa=xa, lora_b=b, lora_scale=2.0)
    want = weight_stationary_gemm(x, codes, torch.bfloat16, config=pointer, **args)
    for cfg in (None, None, dict(pointer, gluon=narrow), dict(pointer, gluon=ring)):
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        got = weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, out=out, **args)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg
    # dX is not narrowed (there the Triton TMA dX was faster than 128-token Gluon tiles): a resident-LoRA config that
    # does not fit leaves the call to the Triton kernels; the ring fits. Same bits on every path.
    gy = torch.randn(M, N, device=DEV).bfloat16()
    gb = (gy @ b).bfloat16()
    dx = torch.empty(M, K, device=DEV, dtype=torch.bfloat16)
    assert gluon.fitting_config(gy, codes.t(), dx, gb, a.t(), *ws.whole_k(N), resident, 256) is None
    assert gluon.fitting_config(gy, codes.t(), dx, gb, a.t(), *ws.whole_k(N), ring, 256) == ring
    dx_args = dict(w_scale=scale, xa=gb, lora_b=a.t(), lora_scale=2.0, op="dx")
    dx_table = {k: v for k, v in ws_config("dx", K, N, 4096).items() if k != "gluon"}
    want = weight_stationary_gemm(gy, codes.t(), torch.bfloat16, config=dict(dx_table, gluon=None, tma=False),
                                  **dx_args)
    for cfg in (None, dict(dx_table, gluon=resident), dict(dx_table, gluon=ring)):
        out = torch.full((M, K), float("nan"), device=DEV, dtype=torch.bfloat16)
        got = weight_stationary_gemm(gy, codes.t(), torch.bfloat16, config=cfg, out=out, **dx_args)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg
    assert "broken" not in ws._GLUON, ws._GLUON


@pytest.mark.parametrize("gluon_cfg", [{"BM": 256, "BK": 64, "num_stages": 4, "GROUP_N": 16}], ids=["registers"])
@pytest.mark.parametrize("K,N", [(4096, 4096), (12288, 4096), (4096, 12288)])
def test_gluon_dx_gives_the_pointer_kernels_bits(K, N, gluon_cfg):
    """The Gluon kernel's dX form (the codes and the LoRA A read transposed through TMA; the codes widened in
    registers) gives the Triton dX pointer kernel's bits: rank 64 and 16 and no
    LoRA, at 257 and 4113 tokens, into NaN-filled outputs, each config twice; as an explicit config (the kernel as it
    is) and through the table (whatever its entry says)."""
    from epirl.kernels.w8a16 import weight_stationary as ws
    from epirl.kernels.w8a16.configs import ws_config
    _, codes, scale, a, b, _ = problem(8, K, N, 64, seed=K + 3 * N)
    gy = torch.randn(4113, N, device=DEV).bfloat16()
    dx_cfg = dict(ws_config("dx", K, N, 4096))
    pointer = {k: v for k, v in dx_cfg.items() if k not in ("gluon", "tma")}
    for M in (257, 4113):
        g = gy[:M]
        for r in (64, 16, 0):
            lora = dict(xa=(g @ b[:, :r]).bfloat16(), lora_b=a[:r].t(), lora_scale=2.0) if r else {}
            assert ws._gluon().gluon_ok(g, codes.t(), torch.empty(M, K, device=DEV), lora.get("xa"),
                                        lora.get("lora_b"), *ws.whole_k(N), gluon_cfg, max(16, r))  # (else Triton)
            want = weight_stationary_gemm(g, codes.t(), torch.bfloat16, w_scale=scale, config=pointer, op="dx", **lora)
            for cfg in (dict(pointer, gluon=gluon_cfg), None, dict(pointer, gluon=gluon_cfg), None):
                out = torch.full((M, K), float("nan"), device=DEV, dtype=torch.bfloat16)
                got = weight_stationary_gemm(g, codes.t(), torch.bfloat16, w_scale=scale, config=cfg, out=out,
                                             op="dx", **lora)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (K, N, M, r, cfg is None)
    assert "broken" not in ws._GLUON, ws._GLUON
