"""Batcher: merging, splitting, bounded queue, deadlines, failures isolated per batch."""

import threading
import time

import pytest
import torch

from recship.serving.batcher import Batcher, DeadlineExpired, QueueFull, merge
from recship.serving.requests import ParsedRequest
from recship.sparse import KeyedJaggedTensor


class Echo:
    """A fake model: logit = row sum of dense + number of ids per example; records batch sizes. ``entered`` is set
    once the worker has called it (and waits on ``gate``, if given)."""

    def __init__(self, delay=0.0, gate=None):
        self.batches = []
        self.delay = delay
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, dense, lengths, values, weights):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        time.sleep(self.delay)
        b = dense.shape[0]
        self.batches.append(b)
        ids = lengths.view(-1, b).sum(0).float()
        return {"out": (dense.sum(1) + ids).unsqueeze(1)}


def _req(batch, seed, features=2, weighted=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (features, batch), generator=g).to(torch.int32)
    n = int(lengths.sum())
    weights = torch.rand(n, generator=g) if weighted else None
    return ParsedRequest(batch, torch.rand(batch, 3, generator=g), lengths, torch.randint(0, 9, (n,), generator=g), weights)


def _expected(r):
    return (r.dense.sum(1) + r.lengths.sum(0).float()).unsqueeze(1)


@pytest.mark.parametrize("weighted", [False, True])
def test_merge_equals_concatenating_the_kjts(weighted):
    reqs = [_req(1 + i % 4, i, features=5, weighted=weighted) for i in range(9)]
    merged = merge(reqs)
    kjts = [KeyedJaggedTensor(keys=list("abcde"), values=r.ids, lengths=r.lengths.view(-1), weights=r.weights) for r in reqs]
    want = KeyedJaggedTensor.concat_batch(kjts)  # recship.sparse's own join along the batch: an independent reference
    assert merged.batch_size == sum(r.batch_size for r in reqs)
    assert torch.equal(merged.lengths.view(-1), want.lengths().to(torch.int32))
    assert torch.equal(merged.ids, want.values())
    if weighted:
        assert torch.equal(merged.weights, want.weights())
    assert torch.equal(merged.dense, torch.cat([r.dense for r in reqs]))


def test_requests_are_merged_and_split_back_in_order():
    gate = threading.Event()
    model = Echo(gate=gate)
    b = Batcher(model, max_batch_size=64, max_delay_s=0.05)
    reqs = [_req(1 + i % 5, i) for i in range(12)]
    futures = [b.submit(r) for r in reqs]
    gate.set()
    for r, f in zip(reqs, futures):
        assert torch.equal(f.result(timeout=30)["out"], _expected(r))
    b.stop()
    assert sum(model.batches) == sum(r.batch_size for r in reqs) and len(model.batches) < len(reqs)


def test_batches_never_exceed_the_limit():
    model = Echo()
    b = Batcher(model, max_batch_size=8, max_delay_s=0.05)
    futures = [b.submit(_req(3, i)) for i in range(10)]
    for f in futures:
        f.result(timeout=30)
    b.stop()
    assert max(model.batches) <= 8


def test_full_queue_refuses_at_once_and_expired_requests_do_not_run():
    gate = threading.Event()
    model = Echo(gate=gate)
    b = Batcher(model, max_batch_size=1, max_delay_s=0.0, max_queue=2)
    running = b.submit(_req(1, 0))
    assert model.entered.wait(timeout=30)  # taken by the worker, blocked on the gate
    deadline = time.monotonic() + 0.2
    expired = b.submit(_req(1, 1), deadline=deadline)
    b.submit(_req(1, 2))
    with pytest.raises(QueueFull):
        b.submit(_req(1, 3))
    while time.monotonic() <= deadline:
        time.sleep(0.01)
    gate.set()
    running.result(timeout=30)
    with pytest.raises(DeadlineExpired):
        expired.result(timeout=30)
    b.stop()
    assert model.batches == [1, 1]  # the expired request never ran


def test_a_failing_forward_fails_only_its_batch():
    class Flaky(Echo):
        def __call__(self, dense, lengths, values, weights):
            if dense.shape[0] == 7:
                raise RuntimeError("boom")
            return super().__call__(dense, lengths, values, weights)

    b = Batcher(Flaky(), max_batch_size=7, max_delay_s=0.0)
    bad = b.submit(_req(7, 0))
    with pytest.raises(RuntimeError, match="boom"):
        bad.result(timeout=30)
    good = b.submit(_req(2, 1))
    assert good.result(timeout=30)["out"].shape == (2, 1)
    b.stop()


def test_stop_during_submits_leaves_no_request_unanswered():
    from recship.serving.batcher import Unloaded

    b = Batcher(Echo(delay=0.001), max_batch_size=4, max_delay_s=0.001)
    accepted, refused = [], []
    lock = threading.Lock()

    def submitter(k):
        give_up = time.monotonic() + 10  # submit until the stop refuses us (bounded in time)
        i = 0
        while time.monotonic() < give_up:
            i += 1
            try:
                f = b.submit(_req(1, k * 1000 + i))
            except Unloaded:
                with lock:
                    refused.append(1)
                return
            except QueueFull:
                time.sleep(0.001)
                continue
            with lock:
                accepted.append(f)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    b.stop(drain=True)
    for t in threads:
        t.join()
    assert refused  # some submits came after the stop...
    for f in accepted:  # ...and every accepted request was answered
        assert f.result(timeout=30)["out"].shape == (1, 1)


def _cancelled(b, seed, deadline=None):
    f = b.submit(_req(1, seed), deadline=deadline)
    assert f.cancel()  # what asyncio.wait_for does to the wrapped future when the client's deadline passes
    return f


@pytest.mark.parametrize("when", ["queued", "expired_and_cancelled", "carried"])
def test_a_cancelled_or_expired_request_in_any_queue_state_does_not_stop_the_worker(when):
    """Regression: set_exception on a future the asyncio side had cancelled killed the worker thread."""
    gate = threading.Event()
    model = Echo(gate=gate)
    b = Batcher(model, max_batch_size=2, max_delay_s=0.05, max_queue=8)
    blocker = b.submit(_req(1, 0))
    assert model.entered.wait(timeout=30)  # the worker took it and waits on the gate
    if when == "queued":
        _cancelled(b, 1)
    elif when == "expired_and_cancelled":
        _cancelled(b, 1, deadline=time.monotonic() + 0.001)
        time.sleep(0.01)
    else:  # a 2-example request that will not fit beside the next one: carried to the following batch
        b.submit(_req(1, 2))
        carried = b.submit(_req(2, 3))
        assert carried.cancel()
    gate.set()
    blocker.result(timeout=30)
    later = [_req(1 + i % 2, 10 + i) for i in range(6)]
    futures = [b.submit(r) for r in later]
    for r, f in zip(later, futures):
        assert torch.equal(f.result(timeout=30)["out"], _expected(r))
    assert b.alive
    b.stop()


def test_stop_with_a_full_queue_returns_at_once_and_answers_everything():
    gate = threading.Event()
    model = Echo(gate=gate)
    b = Batcher(model, max_batch_size=1, max_delay_s=0.0, max_queue=4)
    running = b.submit(_req(1, 0))
    assert model.entered.wait(timeout=30)  # the worker took it and waits on the gate
    queued = [b.submit(_req(1, i)) for i in range(1, 5)]
    with pytest.raises(QueueFull):
        b.submit(_req(1, 9))
    threading.Timer(0.2, gate.set).start()
    started = time.monotonic()
    b.stop(drain=False)
    assert time.monotonic() - started < 5
    assert running.result(timeout=30)["out"].shape == (1, 1)
    for f in queued:
        with pytest.raises(Exception, match="unloaded"):
            f.result(timeout=30)


def test_a_dead_worker_fails_its_requests_refuses_new_ones_and_reports():
    from recship.serving.batcher import WorkerDied

    deaths = []
    b = Batcher(Echo(), max_batch_size=4, max_delay_s=0.0, on_death=deaths.append)

    def broken(carry):
        raise SystemExit("a bug in the worker loop")

    b._collect = broken  # the worker is waiting inside the real _collect: its next call fails
    assert b.submit(_req(1, 0)).result(timeout=30)["out"].shape == (1, 1)
    deadline = time.monotonic() + 30
    while b.died is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(b.died, SystemExit) and len(deaths) == 1 and not b.alive
    with pytest.raises(WorkerDied):
        b.submit(_req(1, 1))
    b.stop()  # returns: the thread is gone


def test_batchers_sharing_a_device_thread_run_their_forwards_on_it_one_at_a_time():
    from recship.serving.batcher import DeviceThread

    class Where(Echo):
        """Echo recording the thread of each forward, its intra-op threads, and how many forwards ran at once."""

        def __init__(self, running):
            super().__init__(delay=0.01)
            self.threads, self.running = [], running

        def __call__(self, dense, lengths, values, weights):
            self.running.append(1)
            self.threads.append((threading.current_thread().name, torch.get_num_threads(), len(self.running)))
            try:
                return super().__call__(dense, lengths, values, weights)
            finally:
                self.running.pop()

    device, running = DeviceThread("test"), []
    models = [Where(running), Where(running)]
    batchers = [Batcher(m, max_batch_size=4, forwards=device, threads=t) for m, t in zip(models, (1, 2))]
    try:
        futures = [(b, i, b.submit(_req(1, i))) for i in range(12) for b in batchers]
        for b, i, f in futures:
            assert torch.equal(f.result(timeout=30)["out"], _expected(_req(1, i)))
        for m, t in zip(models, (1, 2)):
            assert {name for name, _, _ in m.threads} == {"forwards-test"}
            assert {n for _, n, _ in m.threads} == {t}  # each batcher's intra-op threads, set before its forwards
            assert max(at_once for _, _, at_once in m.threads) == 1
        failing = Batcher(lambda *inputs: 1 / 0, forwards=device)  # its failure is its batch's, not the device thread's
        with pytest.raises(ZeroDivisionError):
            failing.submit(_req(1, 0)).result(timeout=30)
        failing.stop()
        assert batchers[0].submit(_req(1, 0)).result(timeout=30)["out"].shape == (1, 1)
    finally:
        for b in batchers:
            b.stop()
        device.stop()
    with pytest.raises(Exception, match="stopping"):
        device.run(lambda: None)


def test_close_window_runs_the_waiting_batch_at_once_and_later_requests_wait_for_no_company():
    """A 30 s window: the first request waits for company; close_window (a stopping server) runs it at once, with
    what was queued beside it in the same forward, and a request submitted afterwards runs alone without waiting."""
    window = 30.0
    model = Echo()
    b = Batcher(model, max_batch_size=64, max_delay_s=window)
    try:
        first = [b.submit(_req(2, 1)), b.submit(_req(3, 2))]
        time.sleep(0.2)  # both taken into the window (nothing else will come)
        assert not any(f.done() for f in first)
        closed = time.monotonic()
        b.close_window()
        answers = [f.result(timeout=window / 3) for f in first]
        assert time.monotonic() - closed < window / 10
        assert model.batches == [5]  # one forward: the window closed on what it held
        late_req = _req(4, 3)
        late = b.submit(late_req)
        assert torch.equal(late.result(timeout=window / 3)["out"], _expected(late_req))
        assert model.batches == [5, 4]
        for f, seed, size in zip(answers, (1, 2), (2, 3)):
            assert torch.equal(f["out"], _expected(_req(size, seed)))
    finally:
        b.stop()
    assert b.pending == 0
