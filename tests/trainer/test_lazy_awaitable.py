"""A sharded collection's output is an awaitable that behaves as its result (TorchRec's LazyAwaitable): indexing,
arithmetic, comparisons, attributes and torch functions wait for it. References: the plain result itself; and for
training a model that indexes the output (``ebc(features)["user"]``) on every sharding type, the same model taking
its features from ``.to_dict()`` (which waits) instead, run after run."""

import math

import pytest
import torch

from recship.sparse import KeyedTensor
from recship.trainer.distributed.types import NoWait
from recship.trainer.train import TrainConfig, launch


def test_an_awaitable_answers_as_its_result():
    g = torch.Generator().manual_seed(0)
    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.rand(4, 5, generator=g))
    assert torch.equal(NoWait(kt)["b"], kt["b"]) and NoWait(kt).keys() == ["a", "b"]
    x, y = torch.rand(3, generator=g) + 0.5, torch.rand(3, generator=g) + 0.5
    lazy = NoWait(x)
    cases = {
        "+": (lazy + y, x + y), "r+": (2.0 + lazy, 2.0 + x), "-": (lazy - y, x - y), "r-": (1.0 - lazy, 1.0 - x),
        "*": (lazy * NoWait(y), x * y), "/": (lazy / y, x / y), "r/": (1.0 / lazy, 1.0 / x), "**": (lazy ** 2, x ** 2),
        "neg": (-lazy, -x), "@": (lazy @ y, x @ y), "[]": (lazy[1:], x[1:]), "<": (lazy < y, x < y),
        "==": (lazy == x, x == x), ">=": (lazy >= 0.9, x >= 0.9), "torch.cat": (torch.cat([lazy, x]), torch.cat([x, x])),
    }
    for op, (got, want) in cases.items():
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), op


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_a_model_indexing_its_sharded_collection_trains_on_every_sharding_type(tmp_path, sharding):
    """On 2 gloo ranks: the same losses, bitwise, as the model indexing the waited KeyedTensor; all finite."""
    def losses(wait_first: bool):
        config = TrainConfig(out=str(tmp_path / str(wait_first)), model="tests.trainer.indexed_model:build",
                             model_args={"wait_first": wait_first}, steps=4, batch_size=16, nproc_per_node=2, sharding=sharding,
                             optimizer="exact_sgd", eval_every=0, eval_batches=1, checkpoint_every=0, progress=False, plot=False)
        return launch(config)["losses"]

    got, want = losses(False), losses(True)
    assert len(got) == 4 and all(math.isfinite(v) for v in got)
    assert got == want, (sharding, got, want)
