"""TorchRec's rank-topology helpers (torchrec.distributed.comm -> recship.distributed): the launcher environment read
as TorchRec reads it (cases checked against TorchRec 1.8.0's functions), and intra/cross-host groups on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import run_ranks
from recship.trainer import comm
from recship.trainer.comm import (get_group_rank, get_local_rank, get_local_size, get_num_groups, get_topology_domain_multiple,
                                  get_topology_group_world_size, intra_and_cross_node_pg)

_VARS = ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "LOCAL_RANK",
         "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "TOPOLOGY_DOMAIN_MULTIPLE",
         "TORCHREC_RESOLVED_POD_SIZE"]

# (environment, world size, rank) -> (local size, local rank, group rank, groups): TorchRec 1.8.0's answers
CASES = [
    ({}, 16, 13, (8, 5, 1, 2)),                                       # nothing set: 8 per host
    ({}, 6, 5, (6, 5, 0, 1)),                                         # 8 does not divide 6: one host
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 13, (4, 1, 3, 4)),
    ({"LOCAL_WORLD_SIZE": "3"}, 16, 13, (16, 13, 0, 1)),              # does not divide: the world size
    ({"MPI_LOCALNRANKS": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 8, 7, (2, 1, 3, 4)),  # first set wins
    ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"}, 16, 13, (4, 2, 3, 4)),  # LOCAL_RANK read as given
    ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "5"}, 16, 13, (4, 1, 3, 4)),  # not below the local size: rank % 4
    ({"LOCAL_WORLD_SIZE": "-1", "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"}, 4, 2, (2, 1, 1, 2)),
]


@pytest.fixture
def env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variables, world, rank, want", CASES)
def test_the_environment_is_read_as_torchrec_reads_it(env, variables, world, rank, want):
    for name, value in variables.items():
        env.setenv(name, value)
    got = (get_local_size(world), get_local_rank(world, rank), get_group_rank(world, rank), get_num_groups(world))
    assert got == want


def test_topology_variables(env):
    assert get_topology_domain_multiple() is None and get_topology_group_world_size(16) == 8
    env.setenv("TOPOLOGY_DOMAIN_MULTIPLE", "3")
    env.setenv("LOCAL_WORLD_SIZE", "2")
    env.setenv("TORCHREC_RESOLVED_POD_SIZE", "2")
    assert get_topology_domain_multiple() == 3 and get_topology_group_world_size(8) == 4
    with pytest.raises(ValueError, match="World size 6 is not a multiple of the topology group: 4"):
        get_topology_group_world_size(6)
    env.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        get_local_size(8)


def _groups(rank, world_size):
    intra, cross = intra_and_cross_node_pg()
    assert intra_and_cross_node_pg() == (intra, cross)  # made once
    out = []
    for pg in (intra, cross):
        t = torch.tensor([10.0 ** rank])
        dist.all_reduce(t, group=pg)
        out.append((dist.get_world_size(pg), float(t)))
    return out, intra_and_cross_node_pg(torch.device("meta"))


@pytest.mark.parametrize("per_host", [1, 2])
def test_intra_and_cross_groups_on_two_ranks(per_host):
    results = run_ranks(_groups, 2, local_world_size=per_host)
    for rank, (sums, meta) in enumerate(results):
        assert meta == (None, None)
        if per_host == 2:  # one host: the intra group is both ranks, each cross group one rank
            assert sums == [(2, 11.0), (1, 10.0 ** rank)]
        else:  # two hosts of one rank: the reverse
            assert sums == [(1, 10.0 ** rank), (2, 11.0)]
    assert comm._INTRA_PG is None  # this process made none
