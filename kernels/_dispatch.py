"""Backend choice shared by every op: Triton on CUDA tensors, the plain-torch reference elsewhere.

`EPIRL_KERNELS=reference` (or `backend="reference"`) forces the reference everywhere; `backend="triton"`
forces Triton (on CPU tensors only under `TRITON_INTERPRET=1`, which the interpreter tests use).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # any import failure means "no Triton": the reference still works
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int = 0) -> bool:
    """Programmatic dependent launch: Triton with gdc_* and a Hopper-or-newer GPU (never in the interpreter)."""
    if interpreting() or not triton_available() or not torch.cuda.is_available():
        return False
    import triton.language as tl
    extra = getattr(getattr(tl, "extra", None), "cuda", None)
    has_gdc = extra is not None and hasattr(extra, "gdc_wait") and hasattr(extra, "gdc_launch_dependents")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


def check_reduction(K: int, what: str = "K") -> None:
    """The GEMM kernels tell the compiler that their K loops run at least once (`tl.assume`: otherwise ptxas
    serializes their wgmmas); an empty reduction is refused here instead of reaching them."""
    if K <= 0:
        raise ValueError(f"{what}={K}: the reduction dimension of a GEMM must be positive")


def use_triton(t: torch.Tensor, backend: str | None) -> bool:
    """Whether this call runs the Triton kernel. `backend` None or "auto" reads EPIRL_KERNELS."""
    choice = backend or os.environ.get("EPIRL_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS}")
    if choice == "reference":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not (t.is_cuda or interpreting()):
            raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
        return True
    return t.is_cuda and triton_available()
