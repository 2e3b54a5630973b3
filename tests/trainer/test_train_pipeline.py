"""``torchrec.distributed.train_pipeline`` as TorchRec users drive it (tests/snippets/torchrec_train_pipeline.txt,
through docs/torchrec.md's import map): ``progress`` until StopIteration trains exactly as the plain loop (zero_grad,
forward, backward, step) over the same batches, bit for bit, unsharded and under DistributedModelParallel on 2 gloo
ranks; the outputs are the model's, batch by batch."""

import copy
from pathlib import Path

import pytest
import torch

from gloo_ranks import run_ranks
from tutorials.notebook import import_map, rewrite_imports, run_snippet

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)
STEPS = 5


def _user_code() -> dict:
    scope = run_snippet("torchrec_train_pipeline")
    return scope


def _plain_loop(model, optimizer, batches):
    """The reference: what a pipeline step promises, written out."""
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, output = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(output)
    return outputs


def _assert_same(outputs, want_outputs, model, want_model):
    assert len(outputs) == len(want_outputs)
    for got, want in zip(outputs, want_outputs):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    got, want = dict(model.named_parameters()), dict(want_model.named_parameters())
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("pipeline, kwargs", [("TrainPipelineBase", {}), ("TrainPipelineSparseDist", {}),
                                              ("TrainPipelineSparseDist", {"enqueue_batch_after_forward": True})])
def test_a_pipeline_trains_as_the_plain_loop(pipeline, kwargs):
    code = _user_code()
    torch.manual_seed(0)
    model = code["SmallTrain"]()
    reference = copy.deepcopy(model)
    batches = code["make_batches"](1, STEPS)
    outputs = code["run_pipeline"](code[pipeline], model, torch.optim.Adagrad(model.parameters(), lr=0.1), batches, **kwargs)
    want = _plain_loop(reference, torch.optim.Adagrad(reference.parameters(), lr=0.1), batches)
    _assert_same(outputs, want, model, reference)
    # it trained: every step's loss is the plain loop's, and the model moved
    assert not torch.equal(model.over.weight, code["SmallTrain"]().over.weight)
    assert [o[0].item() for o in outputs] == [o[0].item() for o in want] and len({o[0].item() for o in outputs}) == STEPS


def test_a_pipeline_reads_ahead_and_stops_as_torchrecs():
    code = _user_code()
    torch.manual_seed(0)
    model = code["SmallTrain"]()
    reference = copy.deepcopy(model)
    batches = code["make_batches"](2, STEPS)
    read = []

    def counting():
        for i, b in enumerate(batches):
            read.append(i)
            yield b

    pipeline = code["TrainPipelineSparseDist"](model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    it = counting()
    pipeline.progress(it)
    assert read == [0, 1, 2]  # batches i, i+1 and i+2 are read before batch i trains
    # execute_all_batches=False stops as soon as the dataloader runs dry: the last two batches read are not trained on
    torch.manual_seed(0)
    model = code["SmallTrain"]()
    outputs = code["run_pipeline"](code["TrainPipelineSparseDist"], model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                                   execute_all_batches=False)
    want = _plain_loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches[: STEPS - 2])
    _assert_same(outputs, want, model, reference)
    # an exhausted pipeline keeps raising StopIteration; an empty dataloader stops the first call
    for name in ["TrainPipelineBase", "TrainPipelineSparseDist"]:
        pipeline = code[name](model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
        with pytest.raises(StopIteration):
            pipeline.progress(iter([]))


def test_in_eval_mode_a_pipeline_only_runs_forward():
    code = _user_code()
    torch.manual_seed(0)
    model = code["SmallTrain"]().eval()
    before = copy.deepcopy(model)
    batches = code["make_batches"](3, 3)
    outputs = code["run_pipeline"](code["TrainPipelineSparseDist"], model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    with torch.no_grad():
        want = [before(b)[1] for b in batches]
    _assert_same(outputs, want, model, before)


def test_what_a_pipeline_refuses():
    code = _user_code()
    model = code["SmallTrain"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="apply_jit"):
        code["TrainPipelineSparseDist"](model, optimizer, torch.device("cpu"), apply_jit=True)
    pipeline = code["TrainPipelineSparseDist"](model.ebc, optimizer, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"returns \(losses, output\)"):
        pipeline.progress(iter(b.sparse_features for b in code["make_batches"](0, 2)))
    with pytest.raises(TypeError, match="has no .to"):
        code["TrainPipelineBase"](model, optimizer, torch.device("cpu")).progress(iter([[1, 2]]))


def _sharded_worker(rank, world_size, pipeline):
    code = _user_code()
    results = []
    for use_pipeline in (True, False):
        torch.manual_seed(0)
        dmp, optimizer = code["sharded"](code["SmallTrain"]())
        initial = {k: v.detach().clone() for k, v in dmp.named_parameters()}
        batches = code["make_batches"](10 + rank, STEPS)
        if use_pipeline:
            outputs = code["run_pipeline"](code[pipeline], dmp, optimizer, batches)
        else:
            outputs = _plain_loop(dmp, optimizer, batches)
        params = {k: v.detach().clone() for k, v in dmp.named_parameters()}
        unchanged = sorted(k for k in params if params[k].numel() and torch.equal(params[k], initial[k]))  # not fbgemm's empty placeholder
        results.append((outputs, params, unchanged))
    return results


@pytest.mark.parametrize("world_size", [2])
def test_a_pipeline_trains_a_sharded_model_as_the_plain_loop(world_size):
    for (outputs, params, unchanged), (want_outputs, want_params, _) in run_ranks(_sharded_worker, world_size, "TrainPipelineSparseDist"):
        assert len(outputs) == len(want_outputs) == STEPS
        for got, want in zip(outputs, want_outputs):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert sorted(params) == sorted(want_params) and all(torch.equal(params[k], want_params[k]) for k in params)
        # every parameter trained: the fused tables (updated in backward) and the dense layers
        assert params and unchanged == []
        assert len({o[0].item() for o in outputs}) == STEPS


GOLDEN = (Path(__file__).parents[1] / "snippets" / "torchrec_golden_training.txt").read_text()


def _golden_worker(rank, world_size):
    scope: dict = {}
    exec(compile(rewrite_imports(GOLDEN, import_map()), "golden_training", "exec"), scope)
    results = []
    for use_pipeline in (True, False):
        torch.manual_seed(0)
        dmp, optimizer = scope["golden_model"]()
        batches = scope["golden_batches"](20 + rank, STEPS)
        if use_pipeline:
            losses = scope["golden_training"](dmp, optimizer, batches)
        else:
            losses = [output[0] for output in _plain_loop(dmp, optimizer, batches)]
        results.append((losses, {k: v.detach().clone() for k, v in dmp.named_parameters()}))
    return results


@pytest.mark.parametrize("world_size", [2])
def test_torchrecs_golden_training_runs_and_equals_the_plain_loop(world_size):
    """TorchRec's golden training example (DLRMTrain, RandomRecDataset, fused sharded tables, WarmupOptimizer,
    TrainPipelineSparseDist) through the import map on 2 gloo ranks: every loss and parameter bitwise the plain loop's."""
    for (losses, params), (want_losses, want_params) in run_ranks(_golden_worker, world_size):
        assert len(losses) == len(want_losses) == STEPS and all(torch.equal(a, b) for a, b in zip(losses, want_losses))
        assert len({round(float(x), 6) for x in losses}) == STEPS  # it trains: every step's loss differs
        assert sorted(params) == sorted(want_params) and all(torch.equal(params[k], want_params[k]) for k in params)


def test_eval_pipeline_runs_forwards_only():
    from recship.distributed import EvalPipelineSparseDist

    code = _user_code()
    torch.manual_seed(0)
    model = code["SmallTrain"]()
    before = copy.deepcopy(model)
    batches = code["make_batches"](3, STEPS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = EvalPipelineSparseDist(model, optimizer, torch.device("cpu"), enable_inplace_copy_batch=True)
    it = iter(batches)
    outputs = []
    with pytest.raises(StopIteration):
        while True:
            outputs.append(pipeline.progress(it))
    want = [before(b)[1] for b in batches]
    assert len(outputs) == STEPS and all(all(torch.equal(g, w) for g, w in zip(got, ref)) for got, ref in zip(outputs, want))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))  # never stepped
    pipeline.reset()


def test_data_loading_thread_reads_ahead_and_hands_over_errors():
    from recship.distributed import DataLoadingThread

    class Flaky(Exception):
        is_retryable = True

    def batches():
        yield torch.tensor([1.0])
        raise Flaky("skipped")  # retriable: the thread goes on to the next batch ... which ends the generator

    loader = DataLoadingThread(torch.device("cpu"), batches(), to_device_non_blocking=False)
    loader.start()
    assert torch.equal(loader.get_next_batch(), torch.tensor([1.0]))
    assert loader.get_next_batch() is None
    with pytest.raises(StopIteration):
        loader.get_next_batch(none_throws=True)
    loader.join(timeout=10)

    def broken():
        yield torch.tensor([2.0])
        raise RuntimeError("disk gone")

    loader = DataLoadingThread(torch.device("cpu"), broken(), to_device_non_blocking=False)
    loader.start()
    assert torch.equal(loader.get_next_batch(), torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match="disk gone"):
        loader.get_next_batch()
    loader.stop()
    loader.join(timeout=10)
