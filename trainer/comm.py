"""TorchRec's rank-topology helpers (``torchrec.distributed.comm``): where a rank sits among hosts, from the launcher's
environment, and the intra-host / cross-host process groups built from it.

    local_size = get_local_size()            # ranks per host: LOCAL_WORLD_SIZE (torchrun), or MPI's
    intra_pg, cross_pg = intra_and_cross_node_pg()

The environment is read as TorchRec reads it, first set variable winning:

    local size   LOCAL_WORLD_SIZE, MPI_LOCALNRANKS, OMPI_COMM_WORLD_LOCAL_SIZE, MV2_COMM_WORLD_LOCAL_SIZE;
                 none set: 8 (a GPU host's usual count); a value that does not divide the world size: the world size
                 (one host), with a warning
    local rank   LOCAL_RANK, MPI_LOCALRANKID, OMPI_COMM_WORLD_LOCAL_RANK, MV2_COMM_WORLD_LOCAL_RANK;
                 none set, or not below the local size: rank % local size, with a warning
    topology     TOPOLOGY_DOMAIN_MULTIPLE (hosts per pod), TORCHREC_RESOLVED_POD_SIZE (hosts per topology group)

A group ("node") is ``local size`` consecutive ranks: group rank = rank // local size, groups = world // local size.
A variable set to something that is not an integer is a ValueError naming it (TorchRec's int() raises bare).
"""

import logging
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_LOCAL_SIZE_VARS = ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"]
_LOCAL_RANK_VARS = ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"]

# the groups intra_and_cross_node_pg made, kept for the process's lifetime as TorchRec keeps them
_INTRA_PG: Optional[dist.ProcessGroup] = None
_CROSS_PG: Optional[dist.ProcessGroup] = None


def _env2int(names: List[str], default: int = -1) -> int:
    """The first of ``names`` set to a value >= 0, else ``default``."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


def get_local_size(world_size: Optional[int] = None) -> int:
    """Ranks per host (``nproc_per_node``); ``world_size`` defaults to the default group's."""
    if world_size is None:
        world_size = dist.get_world_size()
    local_size = _env2int(_LOCAL_SIZE_VARS, 8)
    if local_size <= 0 or world_size % local_size != 0:
        logger.warning("Could not determine LOCAL_WORLD_SIZE from environment, falling back to WORLD_SIZE.")
        local_size = world_size
    return local_size


def get_node_group_size(world_size: Optional[int] = None) -> int:
    """Ranks per host group: ``get_local_size`` (TorchRec's 2D-parallel override does not exist in recship)."""
    return get_local_size(world_size)


def get_local_rank(world_size: Optional[int] = None, rank: Optional[int] = None) -> int:
    """This rank's index on its host; ``rank`` defaults to the default group's."""
    local_rank = _env2int(_LOCAL_RANK_VARS, -1)
    local_size = get_local_size(world_size)
    if local_rank == -1 or local_rank >= local_size:
        logger.warning("Could not determine LOCAL_RANK from environment, falling back to GLOBAL_RANK % LOCAL_SIZE.")
        if rank is None:
            rank = dist.get_rank()
        local_rank = rank % local_size
    return local_rank


def get_group_rank(world_size: Optional[int] = None, rank: Optional[int] = None) -> int:
    """The index of this rank's host: rank // local size (torchrun's GROUP_RANK)."""
    if rank is None:
        rank = dist.get_rank()
    return rank // get_local_size(world_size)


def get_num_groups(world_size: Optional[int] = None) -> int:
    """The number of hosts: world size // local size."""
    if world_size is None:
        world_size = dist.get_world_size()
    return world_size // get_local_size(world_size)


def get_topology_domain_multiple() -> Optional[int]:
    """Hosts per pod (TOPOLOGY_DOMAIN_MULTIPLE), or None when unset."""
    value = _env2int(["TOPOLOGY_DOMAIN_MULTIPLE"], -1)
    return None if value == -1 else value


def get_topology_group_world_size(world_size: Optional[int] = None) -> int:
    """Ranks linked by the fastest interconnect: TORCHREC_RESOLVED_POD_SIZE hosts of ``get_local_size`` ranks, or one
    host when unset. ValueError if the world size is not a multiple of it."""
    local_size = get_local_size(world_size)
    resolved = os.environ.get("TORCHREC_RESOLVED_POD_SIZE")
    if resolved is None:
        logger.warning("TORCHREC_RESOLVED_POD_SIZE not set, utilizing LOCAL_WORLD_SIZE instead.")
        return local_size
    try:
        per_group = int(resolved) * local_size
    except ValueError:
        raise ValueError(f"environment variable TORCHREC_RESOLVED_POD_SIZE={resolved!r} is not an integer") from None
    world_size = dist.get_world_size() if world_size is None else world_size
    if per_group <= 0 or world_size % per_group != 0:
        raise ValueError(f"World size {world_size} is not a multiple of the topology group: {per_group}")
    return per_group


def intra_and_cross_node_pg(
    device: Optional[torch.device] = None, backend: Optional[str] = None
) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """This rank's intra-group and cross-group process groups (made once per process, by every rank together).

    With G = ``get_topology_group_world_size()`` ranks per group, rank r's intra group is the G ranks of its group
    ([r - r % G, ..., r - r % G + G - 1]) and its cross group the ranks at the same position in every group
    ([r % G, r % G + G, ...]). E.g. 4 ranks, 2 per host: intra [0, 1] and [2, 3], cross [0, 2] and [1, 3].
    A meta ``device`` gives (None, None); ``backend`` defaults to the default group's.
    """
    global _INTRA_PG, _CROSS_PG
    if device is not None and device.type == "meta":
        return None, None
    world_size, rank = dist.get_world_size(), dist.get_rank()
    group_size = get_topology_group_world_size(world_size)
    groups = world_size // group_size
    backend = backend or dist.get_backend()
    if _INTRA_PG is None:
        for g in range(groups):  # every rank creates every group (new_group is collective), keeps its own
            pg = dist.new_group(ranks=[g * group_size + i for i in range(group_size)], backend=backend)
            if g == rank // group_size:
                _INTRA_PG = pg
        dist.barrier()
    if _CROSS_PG is None:
        for i in range(group_size):
            pg = dist.new_group(ranks=[i + g * group_size for g in range(groups)], backend=backend)
            if i == rank % group_size:
                _CROSS_PG = pg
        dist.barrier()
    return _INTRA_PG, _CROSS_PG
