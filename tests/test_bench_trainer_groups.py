"""bench_trainer's kernel grouping (CPU): a profiled step's kernels land in the group their name says."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "bench_trainer", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_trainer.py")
bench_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_trainer)


def test_kernel_groups_by_name():
    group = bench_trainer.kernel_group
    assert group("_ws_tma_kernel") == "W8A16 / LoRA (epirl Triton)"
    assert group("_xa_reduce_kernel") == "W8A16 / LoRA (epirl Triton)"
    assert group("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM (cuBLAS)"
    assert group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "GEMM (cuBLAS)"
    assert group("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert group("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "other"


def test_group_table_sums_and_orders(capsys):
    kernels = {"_ws_tma_kernel": (0.5, 10), "nvjet_hsh": (0.2, 3), "elementwise": (0.01, 100)}
    bench_trainer.print_kernel_groups([{"shape": "s", "base": "fp8", "kernels": kernels}], top=2)
    out = capsys.readouterr().out
    assert "W8A16 / LoRA (epirl Triton) 500.0, GEMM (cuBLAS) 200.0, other 10.0" in out
    assert "| `_ws_tma_kernel` | 10 | 500.0 |" in out and "elementwise" not in out.split("kernel ms by group")[1]
