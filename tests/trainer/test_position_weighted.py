"""TorchRec's older feature processors (torchrec.modules.feature_processor -> recship.trainer.position_weighted):
each id weighted by its feature's position weight at its place in its bag, against a plain-PyTorch reference, eager,
fx-traced and scripted after tracing; which keys PositionWeightedProcessor keeps; TorchRec's state_dict keys."""

import pytest
import torch

import recship.fx
from recship.sparse import KeyedJaggedTensor
from recship.trainer.position_weighted import PositionWeightedModule, PositionWeightedProcessor, offsets_to_range_traceble

LENGTHS = {"a": 3, "c": 4}


def _kjt(keys, batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    return KeyedJaggedTensor(keys=keys, values=torch.randint(0, 50, (int(lengths.sum()),), generator=g), lengths=lengths)


def _randomised(module):
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def _reference_weights(kjt: KeyedJaggedTensor, key: str, w: torch.Tensor) -> torch.Tensor:
    """Each id of ``key``: w[its place in its bag], counted by hand."""
    return torch.tensor([float(w[j]) for n in kjt[key].lengths().tolist() for j in range(n)])


def test_offsets_to_range_counts_from_each_bags_start():
    assert offsets_to_range_traceble(torch.tensor([0, 3, 3, 4]), torch.zeros(4)).tolist() == [0, 1, 2, 0]


def test_position_weighted_module_weights_the_dict_features_it_knows():
    pwm = _randomised(PositionWeightedModule(LENGTHS))
    kjt = _kjt(["a", "b", "c"], 6, 1)
    out = pwm(kjt.to_dict())
    assert sorted(out) == ["a", "b", "c"] and out["b"].weights_or_none() is None
    for key in LENGTHS:
        torch.testing.assert_close(out[key].weights(), _reference_weights(kjt, key, pwm.position_weights[key].detach()), rtol=0, atol=0)
        assert torch.equal(out[key].values(), kjt[key].values())
    assert sorted(pwm.state_dict()) == ["position_weights.a", "position_weights.c"]


@pytest.mark.parametrize("keys", [["a", "b", "c"], ["a", "c"]])
def test_position_weighted_processor_keeps_the_weighted_keys(keys):
    pwp = _randomised(PositionWeightedProcessor(LENGTHS))
    kjt = _kjt(keys, 5, 2)
    out = pwp(kjt)
    assert out.keys() == ["a", "c"]
    want = torch.cat([_reference_weights(kjt, k, pwp.position_weights[k].detach()) for k in ("a", "c")])
    torch.testing.assert_close(out.weights(), want, rtol=0, atol=0)
    assert torch.equal(out.values(), torch.cat([kjt["a"].values(), kjt["c"].values()]))
    traced = recship.fx.symbolic_trace(pwp)
    scripted = torch.jit.script(traced)
    for m in (traced, scripted):
        got = m(kjt)
        assert got.keys() == ["a", "c"] and torch.equal(got.weights(), out.weights())
    assert pwp(_kjt(["b"], 3, 3)).keys() == ["b"]  # no position-weighted key: as it came
    assert sorted(pwp.state_dict()) == ["position_weights.a", "position_weights.c"] and list(pwp.named_buffers()) == []
