"""Compiling model.pt2: torch.export of the served module and AOTInductor's package of it (export's side of
``recship.export.aoti``, which holds what a loader needs: the package format's CPU targets, process folders,
loading).

The compiled kernels target ``PORTABLE_ISA`` by default (AVX2, FMA), one thread per inductor kernel (see
``compile_package``), and the package holds no constants: the artifact's tables file has them. Inductor is told
to read no constant's value either, so the program depends on the graph alone and is kept in the compile
cache (``recship.export.compile_cache``) for the next export of the same architecture.
"""

import io
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind

from recship.export.aoti import ISA_VECTOR_BITS, PORTABLE_ISA, AotiError, load, quiet
from recship.export.compile_cache import VALUE_FREE_OPTIONS, CompileCache, baked_constants, program_key
from recship.oserrors import write_bytes
from recship.quantize.flat import IdCheck
from recship.trainer.entry_point import user_files, user_line

log = logging.getLogger(__name__)


def compiler_available() -> bool:
    """Whether ``--format auto`` compiles model.pt2: a C++ compiler for AOTInductor is on PATH
    (``$CXX`` or g++) and the environment does not say ``RECSHIP_AOTI=0``."""
    if os.environ.get("RECSHIP_AOTI", "1") == "0":
        return False
    return shutil.which(os.environ.get("CXX", "g++")) is not None


@dataclass
class AotiPackage:
    """What ``compile_package`` built: the file, its dynamic ranges and how long it took (torch.export included; with
    a compile-cache hit, torch.export and the lookup)."""

    path: Path
    target_isa: str
    dynamic: Dict[str, List[int]]  # input dim -> [min, max]
    compile_seconds: float
    size_bytes: int
    # fqn -> tensor of each constant the package takes at load (it was compiled without them)
    constants: Dict[str, torch.Tensor]


@contextmanager
def _export_mode(module: nn.Module) -> Iterator[None]:
    """Flat lookups check ids with tensor asserts (not Python errors) while torch.export traces ``module``."""
    lookups = [m for m in module.modules() if isinstance(m, IdCheck)]
    saved = [m.asserts for m in lookups]
    for m in lookups:
        m.asserts = True
    try:
        yield
    finally:
        for m, a in zip(lookups, saved):
            m.asserts = a


def export_program(
    module: nn.Module,
    example: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    num_features: int,
    max_batch: int = 1 << 16,
    max_ids: int = 1 << 30,
) -> Any:
    """torch.export's ExportedProgram of ``module``'s forward(dense, lengths, values, weights), B and N dynamic
    (``compile_package``'s arguments); AotiError naming the line of the user's code a capture failed at."""
    dense, lengths, values, weights = example
    if dense.shape[0] < 2 or values.shape[0] < 2:
        raise AotiError("the example request needs a batch of >= 2 and >= 2 ids (sizes 0 and 1 would be specialised)")
    batch = Dim("batch", min=1, max=max_batch)
    ids = Dim("ids", min=0, max=max_ids)
    dynamic = {
        "dense": {0: batch},
        "lengths": {0: num_features * batch},
        "values": {0: ids},
        "weights": None if weights is None else {0: ids},
    }
    module.eval()
    try:
        with _export_mode(module), torch.no_grad(), quiet():
            return torch.export.export(module, (dense, lengths, values, weights), dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # any capture failure ends with its reason, and the line of the user's code it came from
        where = user_line(e, user_files(module))
        raise AotiError(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        + (f" (at {where})" if where else "")) from e


def compile_package(
    module: nn.Module,
    example: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    num_features: int,
    path: Path,
    target_isa: Optional[str] = PORTABLE_ISA,
    max_batch: int = 1 << 16,
    max_ids: int = 1 << 30,
    cache: Optional[CompileCache] = None,
) -> AotiPackage:
    """torch.export (``export_program``) + AOTInductor of ``module``'s forward(dense, lengths, values, weights) into ``path``.

    Args:
        example: one request (dense [B, num_dense], lengths [F*B] int32, values [N] int64,
            weights [N] float32 or None); B and N are dynamic in the package (any B in
            [1, max_batch], N in [0, max_ids]); whether weights are given is fixed.
        target_isa: -march of the compiled kernels (None: the build machine's, ``native``).
        cache: where a program compiled before is taken from, and this one kept (``recship.export.compile_cache``);
            None: compiled afresh, kept nowhere.

    The package holds no constants (``aot_inductor.package_constants_in_so`` off): the tables and
    the dense weights go into the artifact's tables file, and ``load_package`` takes them back.
    """
    start = time.perf_counter()
    program = _constants_as_buffers(export_program(module, example, num_features, max_batch, max_ids))
    # cpp.threads 1: inductor's own kernels run on one thread, their loops never split across threads. Left at its
    # default (the exporting machine's torch.get_num_threads()), a parallel reduction keeps one partial result per
    # thread in an array of that size, indexed by the running thread: a model exported on a 2-core machine wrote
    # past it and crashed any process that ran it with more intra-op threads (seen: the two-tower at 3 and 4), and
    # a float reduction's bits depended on the thread count. GEMMs (extern kernels) still use the caller's threads.
    options: Dict[str, object] = {"aot_inductor.package_constants_in_so": False, "cpp.threads": 1, **VALUE_FREE_OPTIONS}
    if target_isa is not None:
        options["cpp.march"] = target_isa
        if target_isa in ISA_VECTOR_BITS:
            options["cpp.simdlen"] = ISA_VECTOR_BITS[target_isa]
            # the vector ISA is given: inductor takes those this CPU's flags list (/proc/cpuinfo) without compiling and
            # loading a probe program for each (5 probes, 5-7 s of a cold export on 2 cores; cached only in inductor's
            # cache folder); the ISA it picks is the same, and loaders check the host (aoti.cpu_supports)
            options["cpp.vec_isa_ok"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    key = program_key(program, options, target_isa) if cache is not None else None
    if cache is None or key is None:
        fqns = _compile(program, options, path)
    else:
        with cache.compiling(key):  # an export compiling this program now: waited for, then its entry taken
            hit = cache.get(key)
            if hit is not None:
                write_bytes(path, hit.package, f"writing {path.name}")
                fqns = hit.constant_fqns
                log.info("model.pt2: the compiled program of this graph from the compile cache (%s)", hit.folder)
            else:
                fqns = _compile(program, options, path)
                baked = baked_constants(program, fqns)
                if baked:
                    log.warning("model.pt2 not cached: inductor compiled constants into it by value (%s)", ", ".join(baked[:5]))
                else:
                    cache.put(key, path.read_bytes(), fqns)
    seconds = time.perf_counter() - start
    return AotiPackage(
        path, target_isa or "native",
        {"dense.0": [1, max_batch], "lengths.0": [num_features, num_features * max_batch], "values.0": [0, max_ids]},
        seconds, path.stat().st_size, _needed_constants(fqns, program),
    )


def _constants_as_buffers(program: Any) -> Any:
    """``program`` with its lifted tensor constants (tensors a forward makes, ``torch.tensor(positions)``) turned into
    non-persistent buffers of the same names, in place. AOTInductor gives buffers their own names among the
    constants a package takes at load, but renames lifted constants ``_tensor_constant<i>`` (which the program does
    not know): kept out of the package (``always_keep_tensor_constants``), they could not be given back."""
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.CONSTANT_TENSOR:
            spec.kind, spec.persistent = InputKind.BUFFER, False
    return program


def _compile(program: Any, options: Dict[str, object], path: Path) -> List[str]:
    """AOTInductor's package of ``program`` written to ``path``; returns the constants it takes at load (their fqns)."""
    # packaged into memory, then written: torch's zip writer aborts the process (std::terminate in a destructor)
    # when the disk fills under it, where Python's write raises ENOSPC
    package = io.BytesIO()
    try:
        with quiet():
            torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=options)
    except OSError:  # the disk's (full, read-only), not the compiler's: said as such
        raise
    except Exception as e:
        raise AotiError(f"AOTInductor compilation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    write_bytes(path, package.getbuffer(), f"writing {path.name}")
    return list(load(path).get_constant_fqns())


def _needed_constants(fqns: List[str], program: Any) -> Dict[str, torch.Tensor]:
    """fqn -> tensor of the constants ``fqns`` a compiled package asks for, from the exported program."""
    available = {**program.state_dict, **program.constants}
    missing = [f for f in fqns if not isinstance(available.get(f), torch.Tensor)]
    if missing:
        raise AotiError(f"AOTInductor asks for constants the exported program lacks: {missing[:5]}")
    return {f: available[f] for f in fqns}
