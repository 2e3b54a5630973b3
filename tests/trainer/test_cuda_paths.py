"""The CUDA side of issue 30's TorchRec pieces (skipped without CUDA; run on an H200 with torch 2.11+cu130 when they
were written): a variable-batch KJT keeps its batch sizes and inverse indices through ``to("cuda")`` and the
collection on CUDA expands as on the CPU; ``copy_`` refills device-resident KJT buffers from pinned host memory with
``non_blocking``; the pipelines move each batch to the device and train bitwise as the plain loop there."""

import copy

import pytest
import torch
from torch import nn

from recship.datasets import Batch
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def test_variable_batch_on_cuda_expands_as_on_the_cpu():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0", "f1"]),
                                  EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f2"],
                                                     pooling=PoolingType.MEAN)])
    g = torch.Generator().manual_seed(1)
    spkpr = [[3, 4], [2, 2], [5, 1]]
    lengths = torch.randint(0, 5, (17,), generator=g)
    inverse = torch.stack([torch.randint(0, sum(r), (8,), generator=g) for r in spkpr])
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.randint(0, 40, (int(lengths.sum()),), generator=g), lengths=lengths,
                            stride_per_key_per_rank=spkpr, inverse_indices=(["f0", "f1", "f2"], inverse))
    on_cuda = kjt.to(CUDA)
    assert on_cuda.stride_per_key() == kjt.stride_per_key() and on_cuda.stride() == 8
    assert on_cuda.inverse_indices()[1].is_cuda
    want = ebc(kjt).values().detach()
    cuda_ebc = copy.deepcopy(ebc).to(CUDA)
    torch.testing.assert_close(cuda_ebc(on_cuda).values().detach().cpu(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.jit.script(cuda_ebc)(on_cuda).values().detach().cpu(), want, atol=1e-5, rtol=0)


def test_copy_refills_device_buffers_from_pinned_memory():
    g = torch.Generator().manual_seed(2)
    source = KeyedJaggedTensor(keys=["a", "b"], values=torch.randint(0, 9, (12,), generator=g),
                               lengths=torch.tensor([1, 2, 3, 0, 2, 1, 3, 0]), weights=torch.rand(12, generator=g))
    buffer = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(12, dtype=torch.int64), lengths=torch.tensor([3, 3, 0, 0, 1, 1, 2, 2]),
                               weights=torch.zeros(12)).to(CUDA)
    pointer = buffer.values().data_ptr()
    buffer.copy_(source.pin_memory(), non_blocking=True)
    torch.cuda.synchronize()
    assert buffer.values().data_ptr() == pointer and buffer.length_per_key() == source.length_per_key()
    assert torch.equal(buffer.values().cpu(), source.values()) and torch.equal(buffer.weights().cpu(), source.weights())
    assert torch.equal(buffer["b"].lengths().cpu(), source["b"].lengths())


class _SmallTrain(nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=30, feature_names=["a", "b"])])
        self.over = nn.Linear(21, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features)
        logits = self.over(torch.cat([batch.dense_features, pooled["a"], pooled["b"]], 1)).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


@pytest.mark.parametrize("pipeline", [TrainPipelineBase, TrainPipelineSparseDist])
def test_a_pipeline_on_cuda_trains_as_the_plain_loop(pipeline):
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(6):
        lengths = torch.randint(0, 4, (32,), generator=g)
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths=lengths)
        batches.append(Batch(torch.rand(16, 5, generator=g), kjt, torch.randint(0, 2, (16,), generator=g).float()))
    torch.manual_seed(0)
    model = _SmallTrain().to(CUDA)
    reference = copy.deepcopy(model)
    devices = []

    def forward(batch):
        devices.append(batch.dense_features.device.type)
        return model(batch)

    steps = pipeline(model, torch.optim.Adagrad(model.parameters(), lr=0.1), CUDA, custom_model_fwd=forward)
    it, outputs = iter([b.pin_memory() for b in batches]), []
    while True:
        try:
            outputs.append(steps.progress(it))
        except StopIteration:
            break
    optimizer, want = torch.optim.Adagrad(reference.parameters(), lr=0.1), []
    for batch in batches:
        optimizer.zero_grad()
        loss, output = reference(batch.to(CUDA))
        loss.backward()
        optimizer.step()
        want.append(output)
    assert devices == ["cuda"] * 6 and len(outputs) == 6
    assert all(torch.equal(a, b) for o, w in zip(outputs, want) for a, b in zip(o, w))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
