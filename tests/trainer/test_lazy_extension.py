"""lazy_apply and LazyModuleExtensionMixin (TorchRec's lazy_extension), and the pruning logger interface.

Checked against TorchRec 1.8.0 besides (not here): the same lazy_apply sequence called the functions on the same
modules in the same order and gave bit-equal outputs.
"""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from recship.trainer.lazy_extension import LazyModuleExtensionMixin, lazy_apply
from recship.trainer.pruning_logger import PruningLogBase, PruningLogger, PruningLoggerDefault


def test_lazy_apply_runs_once_after_the_first_forward_in_order():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))
    calls = []

    @torch.no_grad()
    def fill(m):
        calls.append(type(m).__name__)
        if isinstance(m, nn.Linear):
            m.weight.fill_(0.5)
            m.bias.zero_()

    assert lazy_apply(seq, fill) is seq
    lazy_apply(seq, lambda m: calls.append("second"))
    assert calls == []
    seq(torch.ones(2, 5))
    assert calls == ["Linear", "ReLU", "Linear", "Sequential"] + ["second"] * 4
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    want = torch.relu(x.sum(1, keepdim=True).expand(4, 3) * 0.5).sum(1, keepdim=True).expand(4, 2) * 0.5
    torch.testing.assert_close(seq(x), want)
    assert len(calls) == 8  # not again


class LazyScale(LazyModuleExtensionMixin, nn.Module):
    """A lazy module whose forward takes a keyword: its parameter's width comes from ``x``."""

    def __init__(self):
        super().__init__()
        self.weight = UninitializedParameter()

    def initialize_parameters(self, x, *, shift=0.0):
        self.weight.materialize((x.shape[1],))
        with torch.no_grad():
            self.weight.fill_(2.0 + shift)

    def forward(self, x, *, shift=0.0):
        return x * self.weight


def test_mixin_passes_keywords_and_refuses_apply_before_initialisation():
    m = LazyScale()
    with pytest.raises(RuntimeError, match="has not been initialized.*lazy_apply"):
        m.apply(lambda _: None)
    out = m(torch.ones(2, 3), shift=1.0)
    assert torch.equal(out, torch.full((2, 3), 3.0))
    seen = []
    m.apply(seen.append)
    assert seen == [m]


def test_pruning_logger_default_yields_a_namespace():
    with PruningLoggerDefault.pruning_logger("PRUNE", trainer="t") as details:
        details.rows = 3
    assert isinstance(details, SimpleNamespace) and details.rows == 3
    with pytest.raises(TypeError):
        PruningLogger()
    assert PruningLogBase() == PruningLogBase()

    records = []

    class Recording(PruningLogger):
        @classmethod
        @contextmanager
        def pruning_logger(cls, event, trainer=None, publisher=None):
            details = SimpleNamespace()
            yield details
            records.append((event, vars(details)))

    with Recording.pruning_logger("EVICT") as d:
        d.evicted = 7
    assert records == [("EVICT", {"evicted": 7})]
