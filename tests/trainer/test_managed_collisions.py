"""Managed collisions (recship.trainer.managed_collisions) against a plain-Python reference.

The reference keeps the slots as a list of [raw id, row, count, last access] sorted by raw id
(empty slots: +inf, the last of them the miss row) and a dict lookup for remapping; at each
eviction it scores slots and new ids with the policy's formula and keeps the best, ties going to
the earlier entry (slots in raw-id order, then new ids by falling count). Remapped ids, evicted
rows, buffers after every step and pooled embeddings must be equal, not close.
(These numbers also equal TorchRec 1.8.0's bit for bit: checked with TorchRec on the same seeded inputs.)
"""

import collections
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

from recship.fx import symbolic_trace
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.managed_collisions import (DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy,
                                                ManagedCollisionCollection, ManagedCollisionEmbeddingBagCollection,
                                                ManagedCollisionEmbeddingCollection, McEmbeddingBagCollectionAdapter,
                                                McEmbeddingCollectionAdapter, MCHManagedCollisionModule, average_threshold_filter,
                                                dynamic_threshold_filter, probabilistic_threshold_filter)

INF = 2**63 - 1
CPU = torch.device("cpu")


class DictMCH:
    """Plain-Python sorted-ids managed collisions: the behaviour the module must reproduce."""

    def __init__(self, zch_size: int, policy: str, interval: int, decay: float = 1.0, threshold: Optional[str] = None) -> None:
        self.n, self.policy, self.interval, self.decay, self.threshold = zch_size, policy, interval, decay, threshold
        self.slots = [[INF, row, 0, 0] for row in range(zch_size)]  # raw id, row, count, last access
        self.iter, self.last_eviction, self.cap = 0, 0, None
        self.history: List[tuple] = []
        self.evicted_rows: Optional[List[int]] = None

    def remap(self, ids: List[int]) -> List[int]:
        rows = {raw: row for raw, row, _, _ in self.slots if raw != INF}
        return [rows.get(i, self.n - 1) for i in ids]

    def step(self, per_table_ids: List[int]) -> None:
        self.iter += 1
        if self.cap is None:
            self.cap = int(len(per_table_ids) * self.interval * 1.25)
        room = self.cap - len(self.history)
        self.history += [(i, self.iter) for i in per_table_ids[:room]]
        if self.iter - self.last_eviction == self.interval:
            self._evict()
            self.last_eviction = self.iter

    def _score(self, count: int, last: int) -> float:
        distance = np.float32(self.iter - last + 1) ** np.float32(self.decay)
        if self.policy == "lfu":
            return count
        if self.policy == "lru":
            return -distance
        return np.float32(count) / distance

    def _evict(self) -> None:
        counts = collections.Counter(i for i, _ in self.history)
        last = {}
        for i, it in self.history:
            last[i] = max(last.get(i, 0), it)
        uniq = sorted(counts)
        if self.threshold == "average":
            mean = np.float32(sum(counts.values())) / np.float32(len(uniq))
            uniq = [i for i in uniq if counts[i] > mean]
        elif self.threshold == "dynamic":
            limit = (1 / len(uniq)) * 1.5 * sum(counts.values())
            uniq = [i for i in uniq if counts[i] > limit]
        candidates = sorted(uniq, key=lambda i: -counts[i])  # stable: ties by raw id
        position = {slot[0]: p for p, slot in enumerate(self.slots) if slot[0] != INF}
        new = []
        for i in candidates:
            if i in position:
                slot = self.slots[position[i]]
                slot[2] += counts[i]
                slot[3] = last[i]
            else:
                new.append(i)
        self.slots[-1][2], self.slots[-1][3] = INF, self.iter  # the miss row keeps its slot
        entries = [(s[2], s[3]) for s in self.slots] + [(counts[i], last[i]) for i in new]
        scores = [self._score(c, a) for c, a in entries]
        ranked = sorted(range(len(entries)), key=lambda k: -scores[k])
        evicted = [k for k in ranked[self.n:] if k < self.n]
        selected = [k - self.n for k in ranked[: self.n] if k >= self.n]
        rows = []
        for e, s in zip(evicted, selected):
            rows.append(self.slots[e][1])
            self.slots[e] = [new[s], self.slots[e][1], counts[new[s]], last[new[s]]]
        self.evicted_rows = rows
        self.slots.sort(key=lambda slot: slot[0])
        self.history = []


def make_policy(name: str, threshold: Optional[str], decay: float):
    filt = {None: None, "average": average_threshold_filter, "dynamic": lambda c: dynamic_threshold_filter(c, 1.5)}[threshold]
    if name == "lfu":
        return LFU_EvictionPolicy(threshold_filtering_func=filt)
    if name == "lru":
        return LRU_EvictionPolicy(decay_exponent=decay, threshold_filtering_func=filt)
    return DistanceLFU_EvictionPolicy(decay_exponent=decay, threshold_filtering_func=filt)


TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
          EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=7, feature_names=["f2"])]
INTERVAL = {"t0": 2, "t1": 1}


def batches(seed: int, n: int, keys=("f2", "f0", "f1"), batch: int = 4, high: int = 40) -> List[KeyedJaggedTensor]:
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = g.integers(0, 6, size=len(keys) * batch)
        values = g.integers(0, high, size=int(lengths.sum()))
        out.append(KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths)))
    return out


def mc_ebc(policy: str, threshold: Optional[str] = None, decay: float = 1.0) -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(0)
    mcc = ManagedCollisionCollection(
        {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=CPU, eviction_policy=make_policy(policy, threshold, decay),
                                           eviction_interval=INTERVAL[t.name], input_hash_size=100) for t in TABLES},
        TABLES,
    )
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(TABLES), mcc, return_remapped_features=True)


def per_table_ids(kjt: KeyedJaggedTensor) -> Dict[str, List[int]]:
    d = kjt.to_dict()
    return {t.name: [i for f in t.feature_names for i in d[f].values().tolist()] for t in TABLES}


@pytest.mark.parametrize("policy,threshold,decay", [("lfu", None, 1.0), ("lru", None, 1.5), ("dlfu", None, 1.0),
                                                    ("lfu", "average", 1.0), ("dlfu", "dynamic", 2.0)])
def test_training_steps_match_dict_reference(policy: str, threshold: Optional[str], decay: float) -> None:
    model = mc_ebc(policy, threshold, decay)
    refs = {t.name: DictMCH(t.num_embeddings, policy, INTERVAL[t.name], decay, threshold) for t in TABLES}
    weights = {t.name: model._embedding_module.embedding_bags[t.name].weight.detach().clone() for t in TABLES}
    evictions = 0
    for step, kjt in enumerate(batches(1, 8)):
        ids = per_table_ids(kjt)
        for name, ref in refs.items():
            ref.evicted_rows = None
            ref.step(ids[name])
        pooled, remapped = model(kjt)
        assert remapped.keys() == ["f0", "f1", "f2"]  # the tables' order
        want = refs["t0"].remap(ids["t0"]) + refs["t1"].remap(ids["t1"])
        assert remapped.values().tolist() == want, step
        # pooled = plain sums of the remapped rows
        rd = remapped.to_dict()
        for t in TABLES:
            for f in t.feature_names:
                rows, lengths = rd[f].values(), rd[f].lengths().tolist()
                bags = torch.split(weights[t.name][rows], lengths)
                expect = torch.stack([b.sum(0) if len(b) else torch.zeros(t.embedding_dim) for b in bags])
                torch.testing.assert_close(pooled[f], expect, rtol=0, atol=1e-6)
        state = model.state_dict()
        for t in TABLES:
            prefix = f"_managed_collision_collection._managed_collision_modules.{t.name}."
            slots = refs[t.name].slots
            assert state[prefix + "_mch_sorted_raw_ids"].tolist() == [s[0] for s in slots]
            assert state[prefix + "_mch_remapped_ids_mapping"].tolist() == [s[1] for s in slots]
            assert state[prefix + "_current_iter_tensor"].tolist() == [step + 1]
            if policy != "lru":
                assert state[prefix + "_mch_counts"].tolist() == [s[2] for s in slots]
            if policy != "lfu":
                assert state[prefix + "_mch_last_access_iter"].tolist() == [s[3] for s in slots]
        # rows handed to other ids this step (the collection's evict() was consumed by forward)
        module = model._managed_collision_collection._managed_collision_modules["t1"]
        evictions += len(refs["t1"].evicted_rows or [])
        assert module.evict() is None
    assert evictions > 5  # the test saw slots change hands


def test_eval_remaps_only_and_state_dict_round_trip() -> None:
    model = mc_ebc("dlfu")
    for kjt in batches(2, 5):
        model(kjt)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = batches(3, 1)[0]
    pooled, remapped = model(probe)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # eval: no profiling, no eviction
    keys = [k for k in after if k.startswith("_managed_collision_collection._managed_collision_modules.t0.")]
    assert [k.rsplit(".", 1)[1] for k in keys] == ["_output_segments_tensor", "_current_iter_tensor", "_mch_sorted_raw_ids",
                                                   "_mch_remapped_ids_mapping", "_mch_counts", "_mch_last_access_iter"]
    fresh = mc_ebc("dlfu")
    fresh.load_state_dict(after)
    fresh.eval()
    pooled2, remapped2 = fresh(probe)
    assert torch.equal(remapped.values(), remapped2.values()) and torch.equal(pooled.values(), pooled2.values())
    # a loaded state is re-sorted (validate_state): shuffled slots remap the same
    shuffled = dict(after)
    perm = torch.randperm(10)
    for name in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts", "_mch_last_access_iter"):
        key = f"_managed_collision_collection._managed_collision_modules.t0.{name}"
        shuffled[key] = after[key][perm]
    fresh.load_state_dict(shuffled)
    assert torch.equal(fresh(probe)[1].values(), remapped.values())
    # a checkpoint whose segments do not cover the module's rows is refused
    bad = dict(after)
    bad["_managed_collision_collection._managed_collision_modules.t0._output_segments_tensor"] = torch.full((1025,), -1)
    with pytest.raises(ValueError, match="output segments"):
        fresh.load_state_dict(bad)


def test_training_resumes_from_checkpoint_like_uninterrupted() -> None:
    data = batches(4, 6)
    whole = mc_ebc("lru")
    for kjt in data:
        whole(kjt)
    first = mc_ebc("lru")
    for kjt in data[:3]:
        first(kjt)
    resumed = mc_ebc("lru")
    resumed.load_state_dict(first.state_dict())
    for kjt in data[3:]:
        resumed(kjt)
    # the iteration counter travels in _current_iter_tensor; the history restarts at the checkpoint
    t1 = "_managed_collision_collection._managed_collision_modules.t1."  # eviction_interval 1: nothing pending
    for name in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter", "_current_iter_tensor"):
        assert torch.equal(whole.state_dict()[t1 + name], resumed.state_dict()[t1 + name]), name


def test_embedding_collection_and_fx_script() -> None:
    tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=9, feature_names=["a", "b"])]
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(zch_size=9, device=CPU, eviction_policy=LRU_EvictionPolicy(),
                                                                     eviction_interval=1, input_hash_size=50)}, tables)
    model = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables), mcc, return_remapped_features=True)
    ref = DictMCH(9, "lru", 1)
    data = batches(5, 4, keys=("a", "b"), high=25)
    weight = model._embedding_module.embeddings["t"].weight.detach()
    for kjt in data:
        ref.step([i for f in ("a", "b") for i in kjt[f].values().tolist()])
        out, remapped = model(kjt)
        for f in ("a", "b"):
            rows = torch.tensor(ref.remap(kjt[f].values().tolist()), dtype=torch.int64)
            assert torch.equal(out[f].values(), weight[rows]) and torch.equal(out[f].lengths(), kjt[f].lengths())
    model.eval()
    probe = batches(6, 1, keys=("b", "a"), high=25)[0]
    eager = model(probe)
    traced = symbolic_trace(model)
    scripted = torch.jit.script(traced)
    for m in (traced, scripted):
        out, remapped = m(probe)
        assert torch.equal(remapped.values(), eager[1].values())
        assert all(torch.equal(out[f].values(), eager[0][f].values()) for f in ("a", "b"))


def test_ebc_fx_and_script_in_eval() -> None:
    model = mc_ebc("lfu")
    for kjt in batches(7, 4):
        model(kjt)
    model.eval()
    probe = batches(8, 1, keys=("f0", "f1", "f2", "extra"))[0]  # an extra key is dropped
    pooled, remapped = model(probe)
    scripted = torch.jit.script(symbolic_trace(model))
    pooled2, remapped2 = scripted(probe)
    assert torch.equal(pooled.values(), pooled2.values()) and torch.equal(remapped.values(), remapped2.values())
    assert remapped2.keys() == ["f0", "f1", "f2"]


def test_threshold_filters_and_rebuild() -> None:
    counts = torch.tensor([1, 5, 2, 9, 3])
    mask, threshold = average_threshold_filter(counts)
    assert mask.tolist() == [c > 4.0 for c in counts.tolist()] and float(threshold) == 4.0
    mask, threshold = dynamic_threshold_filter(counts, 2.0)
    assert mask.tolist() == [c > 8.0 for c in counts.tolist()]
    torch.manual_seed(1)
    mask, draws = probabilistic_threshold_filter(counts, 0.2)
    assert mask.tolist() == [1 - 0.8 ** c > d for c, d in zip(counts.tolist(), draws.tolist())]
    module = MCHManagedCollisionModule(zch_size=10, device=CPU, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1, input_hash_size=64)
    shard = module.rebuild_with_output_id_range((5, 10), [0, 5, 10])
    assert shard.output_size() == 5 and shard.buckets() == 2 and shard.input_size() == 64
    assert shard._mch_remapped_ids_mapping.tolist() == [5, 6, 7, 8, 9]
    shard.eval()
    out = shard({"t": JaggedTensor(values=torch.tensor([3, 4]), lengths=torch.tensor([2]))})
    assert out["t"].values().tolist() == [9, 9]  # misses: the shard's last row
    assert int(module.open_slots()) == 9


def test_adapters() -> None:
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["a"])]
    adapter = McEmbeddingBagCollectionAdapter(tables, input_hash_size=100, device=CPU, world_size=1, zch_method="sort_zch")
    assert [n for n, _ in adapter.named_parameters()] == ["mc_embedding_bag_collection._embedding_module.embedding_bags.t.weight"]
    assert len(list(adapter.parameters())) == 1 and adapter.embedding_bag_configs() == tables
    adapter.mc_embedding_bag_collection._embedding_module.embedding_bags["t"].to_empty(device=CPU)
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([7, 7, 3]), lengths=torch.tensor([2, 1]))
    out = adapter(kjt)  # eviction every step: after the first, 7 and 3 have slots
    assert out["a"].shape == (2, 4)
    remapped = adapter.mc_embedding_bag_collection._managed_collision_collection(kjt)
    assert sorted(set(remapped.values().tolist())) != [7] and max(remapped.values().tolist()) < 8
    ec_tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["a"])]
    ec_adapter = McEmbeddingCollectionAdapter(ec_tables, input_hash_size=100, device=CPU, world_size=1, zch_method="sort_zch")
    assert ec_adapter.embedding_bag_configs() == ec_tables
    with pytest.raises(NotImplementedError, match="zero_collision_hash"):
        McEmbeddingBagCollectionAdapter(tables, input_hash_size=100, device=CPU, world_size=1, zch_method="mpzch")


def test_mistakes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="zch_size"):
        MCHManagedCollisionModule(zch_size=0, device=CPU, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    with pytest.raises(ValueError, match="eviction_interval"):
        MCHManagedCollisionModule(zch_size=4, device=CPU, eviction_policy=LFU_EvictionPolicy(), eviction_interval=0)
    small = MCHManagedCollisionModule(zch_size=5, device=CPU, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    with pytest.raises(ValueError, match="num_embeddings=10"):
        ManagedCollisionCollection({"t0": small}, TABLES[:1])
    with pytest.raises(ValueError, match="not present"):
        ManagedCollisionCollection({}, TABLES[:1])
    model = mc_ebc("lfu")
    with pytest.raises(ValueError, match="'f2'"):
        model(KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1]), lengths=torch.tensor([1, 0])))
    other = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f0", "f1"])]
    with pytest.raises(ValueError, match="same embedding configs"):
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(other), model._managed_collision_collection)


def test_reset_parameters_and_meta_device_give_a_new_module() -> None:
    """materialize() of a model built on the meta device (to_empty, then reset_parameters) and a reset of a trained
    module both give a new module's state, which then trains as a new module does."""
    from recship.modules.embedding_modules import materialize

    data = batches(9, 6)
    fresh = mc_ebc("dlfu")
    for kjt in data[:3]:
        fresh(kjt)
    trained = mc_ebc("dlfu")
    for kjt in batches(10, 4):
        trained(kjt)
    for m in trained._managed_collision_collection._managed_collision_modules.values():
        m.reset_parameters()
    meta_mcc = ManagedCollisionCollection(
        {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=torch.device("meta"), eviction_policy=DistanceLFU_EvictionPolicy(),
                                           eviction_interval=INTERVAL[t.name], input_hash_size=100) for t in TABLES}, TABLES)
    on_meta = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(TABLES, device="meta"), meta_mcc, return_remapped_features=True)
    materialize(on_meta, "cpu")
    for model in (trained, on_meta):
        for kjt in data[:3]:
            _, remapped = model(kjt)
        prefix = "_managed_collision_collection._managed_collision_modules."
        for key, value in fresh.state_dict().items():
            if key.startswith(prefix):
                assert torch.equal(model.state_dict()[key], value), key
