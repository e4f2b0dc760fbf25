"""w8a8_multi_lora's kernels compiled for Hopper (sm_90) on the CPU, without a GPU: K1 and the decode K2 lower,
K2's main loop uses FP8 wgmma, and the PDL variants carry griddepcontrol (launch_dependents in K1, wait in K2).
Catches lowering errors of the GPU path in CPU CI; numerics are the interpreter and GPU tests' job."""

import pytest

triton = pytest.importorskip("triton")

from conftest import ptx_for  # noqa: E402

from epirl.kernels.fp8_quant.reference import FP8_MAX, MIN_SCALE  # noqa: E402

K1_SIG = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "a_tab": "*i64", "ids_ptr": "*i64",
          "part_ptr": "*fp32", "M": "i32", "K": "i32", "R": "i32", "K_CHUNK": "i32", "N_CHUNKS": "i32",
          "stride_xm": "i32", "stride_qm": "i32", "stride_al": "i32", "stride_ar": "i32", "stride_ak": "i32"}
K2_SIG = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "y_ptr": "*bf16", "ws_ptr": "*fp32",
          "order_ptr": "*i64", "ids_ptr": "*i64", "part_ptr": "*fp32", "b_tab": "*i64", "bl_tab": "*i64",
          "starts_ptr": "*i32", "sigma_ptr": "*fp32", "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
          "R": "i32", "N_CHUNKS": "i32", "N_SLICES": "i32", "sigma_const": "fp32", "stride_xm": "i32",
          "stride_wn": "i32", "stride_ym": "i32", "stride_bn": "i32"}


def test_k1_quant_shrink_lowers_with_pdl_trigger():
    from epirl.kernels.w8a8_multi import triton as kernels

    consts = dict(QUANT=True, HAS_LORA=True, LAUNCH_DEPENDENTS=True, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BR=64,
                  BK=kernels.SHRINK_BK, QBK=kernels.QUANT_BK)
    ptx = ptx_for(kernels._quant_shrink_kernel, K1_SIG, consts, num_warps=8, num_stages=4)
    assert "griddepcontrol.launch_dependents" in ptx


def test_k2_decode_lowers_to_fp8_wgmma_and_waits_for_k1():
    from epirl.kernels.w8a8_multi import triton as kernels

    cfg = kernels.DECODE_CONFIG
    consts = dict(HAS_BASE=True, HAS_ORDER=False, HAS_LORA=True, SIGMA_PER_ADAPTER=True, HAS_BIAS=False,
                  WAIT_PDL=True, DOT_F32=False, BN=cfg["BN"], BT=cfg["BT"], BK=cfg["BK"], BR=64, GROUP_N=8)
    ptx = ptx_for(kernels._multi_lora_gemm_kernel, K2_SIG, consts, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    assert "griddepcontrol.wait" in ptx
    assert "wgmma.mma_async" in ptx and "e4m3" in ptx


GROUPED_SIG = {"x_ptr": "*bf16", "a_tab": "*i64", "ids_ptr": "*i64", "order_ptr": "*i64", "part_ptr": "*fp32",
               "M": "i32", "K": "i32", "R": "i32", "K_CHUNK": "i32", "N_CHUNKS": "i32", "stride_xm": "i32",
               "stride_al": "i32", "stride_ar": "i32", "stride_ak": "i32"}


def test_grouped_shrink_lowers_to_bf16_wgmma():
    """The prefill shrink runs on tensor cores (bf16 wgmma with fp32 accumulation), not CUDA-core FMAs."""
    from epirl.kernels.w8a8_multi import triton as kernels

    cfg = kernels.GROUPED_SHRINK_CONFIG
    consts = dict(HAS_ORDER=True, DOT_F32=False, BT=cfg["BT"], BR=64, BK=cfg["BK"])
    ptx = ptx_for(kernels._grouped_shrink_kernel, GROUPED_SIG, consts, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    assert "wgmma.mma_async" in ptx and ".bf16" in ptx and ".f32.bf16.bf16" in ptx


def test_chunk_sum_lowers():
    from epirl.kernels.w8a8_multi import triton as kernels

    ptx = ptx_for(kernels._sum_chunks_kernel, {"part_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N_CHUNKS": "i32"},
                  dict(BR=64, BLOCK=1024), num_warps=4)
    assert "ld.global" in ptx and "add.f32" in ptx and "fma" not in ptx  # plain adds in chunk order, no contraction


SEG_META = {"tokens_ptr": "*i32", "lora_ids_ptr": "*i32", "counts_ptr": "*i32"}
SEG_SHRINK_SIG = {"x_ptr": "*bf16", "a_tab": "*i64", **SEG_META, "part_ptr": "*fp32", "M": "i32", "K": "i32",
                  "R": "i32", "S": "i32", "K_CHUNK": "i32", "N_CHUNKS": "i32", "stride_xm": "i32", "stride_al": "i32",
                  "stride_ar": "i32", "stride_ak": "i32"}
SEG_EXPAND_SIG = {"y_ptr": "*bf16", **SEG_META, "part_ptr": "*fp32", "b_tab": "*i64", "bl_tab": "*i64",
                  "slice_starts_ptr": "*i32", "sigma_ptr": "*fp32", "M": "i32", "R": "i32", "S": "i32",
                  "N_CHUNKS": "i32", "GROUPS": "i32", "sigma_const": "fp32", "stride_ym": "i32", "stride_bn": "i32"}


@pytest.mark.parametrize("sum_chunks", [True, False])
def test_segmented_shrink_lowers_to_bf16_wgmma(sum_chunks):
    """The segment-tiled shrink (one adapter per tile; the chunks summed in the program or split over programs)
    runs on tensor cores, and its chunk sum is plain adds (no FMA contraction into the dot)."""
    from epirl.kernels.w8a8_multi import segmented

    cfg = segmented.SEG_SHRINK_CONFIG
    consts = dict(SUM_CHUNKS=sum_chunks, DOT_F32=False, BT=cfg["BT"], BR=64, BK=cfg["BK"], BS=64)
    ptx = ptx_for(segmented._seg_shrink_kernel, SEG_SHRINK_SIG, consts, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    assert "wgmma.mma_async" in ptx and ".f32.bf16.bf16" in ptx


def test_segmented_expand_lowers_to_bf16_wgmma_with_explicit_fma():
    from epirl.kernels.w8a8_multi import segmented

    cfg = segmented.SEG_EXPAND_CONFIG
    consts = dict(SIGMA_PER_ADAPTER=False, DOT_F32=False, BN=cfg["BN"], BT=cfg["BT"], BR=64, BS=64,
                  NUM_STAGES=cfg["num_stages"])
    ptx = ptx_for(segmented._seg_expand_kernel, SEG_EXPAND_SIG, consts, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    assert "wgmma.mma_async" in ptx and ".f32.bf16.bf16" in ptx and "fma.rn.f32" in ptx
