"""TorchRec's PT2 helpers (``torchrec.pt2.checks``, re-exported by ``torchrec.sparse.jagged_tensor``): whether
torch.compile / torch.export is tracing, and size facts stated to the compiler (``torch._check``) while it is.
Outside a compilation (eager, TorchScript) each check returns its input untouched."""

from typing import List

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true


def is_torchdynamo_compiling() -> bool:
    """True while TorchDynamo traces (torch.compile, strict torch.export)."""
    if torch.jit.is_scripting():
        return False
    return torch.compiler.is_dynamo_compiling()


def is_non_strict_exporting() -> bool:
    """True while non-strict torch.export traces (compiling, but not through Dynamo)."""
    if torch.jit.is_scripting():
        return False
    return not is_torchdynamo_compiling() and torch.compiler.is_compiling()


def is_pt2_compiling() -> bool:
    """True while torch.compile or torch.export traces, by Dynamo or not."""
    if torch.jit.is_scripting():
        return False
    return is_torchdynamo_compiling() or torch.compiler.is_compiling()


def pt2_checks_tensor_slice(tensor: torch.Tensor, start_offset: int, end_offset: int, dim: int = 0) -> None:
    """States 0 <= start_offset <= end_offset <= tensor.size(dim) to the compiler."""
    if torch.jit.is_scripting() or not is_pt2_compiling():
        return
    torch._check(start_offset >= 0)
    torch._check(end_offset >= 0)
    torch._check(end_offset - start_offset >= 0)
    torch._check(start_offset <= tensor.size(dim))
    torch._check(end_offset <= tensor.size(dim))
    torch._check(end_offset >= start_offset)


def pt2_checks_all_is_size(x: List[int]) -> List[int]:
    """``x``, each element stated non-negative (a size) to the compiler."""
    if torch.jit.is_scripting() or not is_pt2_compiling():
        return x
    for i in x:
        torch._check(i >= 0)
    return x


def pt2_check_size_nonzero(x: torch.Tensor) -> torch.Tensor:
    """``x``, each of its sizes stated positive to the compiler."""
    if torch.jit.is_scripting() or not is_pt2_compiling():
        return x
    for i in range(x.dim()):
        torch._check(x.size(i) > 0)
    return x


def pt2_guard_or_false(x: bool) -> bool:
    """``x``; while compiling, False where it depends on an unbacked size (``guard_or_false``)."""
    if torch.jit.is_scripting() or not is_pt2_compiling():
        return x

    return guard_or_false(x)


def pt2_guard_or_true(x: bool) -> bool:
    """``x``; while compiling, True where it depends on an unbacked size (``guard_or_true``)."""
    if torch.jit.is_scripting() or not is_pt2_compiling():
        return x

    return guard_or_true(x)


__all__ = ["is_non_strict_exporting", "is_pt2_compiling", "is_torchdynamo_compiling", "pt2_check_size_nonzero",
           "pt2_checks_all_is_size", "pt2_checks_tensor_slice", "pt2_guard_or_false", "pt2_guard_or_true"]
