"""Which implementation runs a kernel: the Triton kernel or its PyTorch reference.

Triton runs natively on CUDA tensors, and on CPU tensors only under its interpreter
(``TRITON_INTERPRET=1``, read when a kernel is decorated, so it must be set before this package
is imported). ``impl="auto"`` picks Triton on a GPU and the reference on a CPU (the interpreter
is for tests: ~1 ms per program); ``impl="triton"`` or ``"torch"`` forces one.
"""

from __future__ import annotations

import os

import torch

from kvpool.errors import BadRequest

IMPLS = ("auto", "triton", "torch")

try:  # NOTE: triton is a dependency, but a broken install must not break the pure-torch paths.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only on a broken install
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device`` in this process."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for the given tensors; a clear error when Triton was asked for
    and cannot run here."""
    if impl not in IMPLS:
        raise BadRequest(f"impl={impl!r} is not one of {IMPLS}")
    device = tensors[0].device if tensors else torch.device("cpu")
    for t in tensors[1:]:
        if t.device != device:
            raise BadRequest(f"tensors are on different devices ({device} and {t.device}); move them to one")
    if impl == "torch":
        return "torch"
    if impl == "auto":
        return "triton" if device.type == "cuda" and HAVE_TRITON else "torch"
    if not triton_runs_on(device):
        raise BadRequest(
            f"impl='triton' cannot run on {device} here: use a CUDA tensor, or set TRITON_INTERPRET=1 "
            "before importing kvpool.kernels to run Triton's interpreter on the CPU"
        )
    return "triton"
