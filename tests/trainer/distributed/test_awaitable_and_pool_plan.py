"""TorchRec's EmbeddingBagCollectionAwaitable constructor (awaitables, embedding_dims, embedding_names, ...) and the
object-pool plan types (ObjectPoolShardingType, ObjectPoolShardingPlan with TorchRec's serialized form)."""

import pytest
import torch

from recship.distributed import (EmbeddingBagCollectionAwaitable, ModuleShardingPlan, NoWait, ObjectPoolShardingPlan,
                                 ObjectPoolShardingType)
from recship.trainer.distributed.types import Awaitable


class _Counted(Awaitable[torch.Tensor]):
    def __init__(self, value: torch.Tensor, log: list, name: str) -> None:
        super().__init__()
        self._value, self._log, self._name = value, log, name

    def _wait_impl(self) -> torch.Tensor:
        self._log.append(self._name)
        return self._value


def test_ebc_awaitable_concatenates_groups_into_a_keyed_tensor():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    log: list = []
    out = EmbeddingBagCollectionAwaitable([_Counted(a, log, "a"), _Counted(b, log, "b")], [4, 2, 2], ["f0", "f1", "f2"],
                                          module_fqn="sparse.ebc", sharding_types=["table_wise", "row_wise"],
                                          resize_awaitables=[_Counted(torch.empty(0), log, "resize")])
    assert log == []  # lazy: nothing waited before it is used
    kt = out.wait()
    assert log == ["a", "b", "resize"]
    assert kt.keys() == ["f0", "f1", "f2"] and kt.length_per_key() == [4, 2, 2]
    assert torch.equal(kt.values(), torch.cat([a, b], dim=1))
    assert torch.equal(out["f1"], a[:, 4:6]) and torch.equal(out["f2"], b)  # used as its result, as TorchRec's
    one = EmbeddingBagCollectionAwaitable([NoWait(a)], [6], ["x"])
    assert one.wait().values() is a  # one group: no copy


def test_ebc_awaitable_refuses_mismatches():
    with pytest.raises(ValueError, match="one embedding dim per embedding name"):
        EmbeddingBagCollectionAwaitable([NoWait(torch.zeros(2, 4))], [4], ["f0", "f1"])
    with pytest.raises(ValueError, match="one sharding type per awaitable"):
        EmbeddingBagCollectionAwaitable([NoWait(torch.zeros(2, 4))], [4], ["f0"], sharding_types=["a", "b"])
    with pytest.raises(ValueError, match=r"need \[B, 5\]"):
        EmbeddingBagCollectionAwaitable([NoWait(torch.zeros(2, 4))], [4, 1], ["f0", "f1"]).wait()


def test_object_pool_plan():
    assert [m.value for m in ObjectPoolShardingType] == ["row_wise", "replicated_row_wise"]
    plan = ObjectPoolShardingPlan(ObjectPoolShardingType.REPLICATED_ROW_WISE)
    assert isinstance(plan, ModuleShardingPlan) and plan.inference is False and plan.memory_capacity_per_rank is None
    assert plan._serialize() == {"sharding_type": "REPLICATED_ROW_WISE", "inference": False}
    uneven = ObjectPoolShardingPlan(ObjectPoolShardingType.ROW_WISE, inference=True, memory_capacity_per_rank=[100, 300])
    assert uneven._serialize() == {"sharding_type": "ROW_WISE", "inference": True, "memory_capacity_per_rank": [100, 300]}
    with pytest.raises(TypeError, match="ObjectPoolShardingType"):
        ObjectPoolShardingPlan("row_wise")
    with pytest.raises(ValueError, match="memory_capacity_per_rank"):
        ObjectPoolShardingPlan(ObjectPoolShardingType.ROW_WISE, memory_capacity_per_rank=[-1])
