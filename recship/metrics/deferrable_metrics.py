"""DeferrableMetrics: the mapping ``RecMetricModule.compute()`` returns, holding either the values or a Future of
them (TorchRec's asynchronous metric modules hand back a Future; recship's modules compute synchronously, so theirs
is always resolved). Reading it like a dict resolves it; ``subscribe(callback)`` is the non-blocking way.
"""

import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

logger: logging.Logger = logging.getLogger(__name__)


def device_supports_async(device: torch.device) -> bool:
    """Whether results on ``device`` can be copied to the host without blocking (CUDA)."""
    return device.type == "cuda"


def transfer_tensors_to_cpu(tensors: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional["torch.cuda.Event"]]:
    """``tensors`` with CUDA tensors copied to pinned host memory without blocking, and the CUDA event that marks
    the copies done (None, and the dict as it is, when nothing is on CUDA). Non-tensors pass through."""
    device = next((v.device for v in tensors.values() if isinstance(v, torch.Tensor) and v.device.type == "cuda"), None)
    if device is None:
        return tensors, None
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out: Dict[str, Any] = {}
            for key, value in tensors.items():
                if isinstance(value, torch.Tensor):
                    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
                    host.copy_(value, non_blocking=True)
                    value.record_stream(stream)
                    out[key] = host
                else:
                    out[key] = value
            event = torch.cuda.Event()
            event.record()
    return out, event


class DeferrableMetrics(Mapping):
    """Metric values now (a dict) or later (a Future of a dict).

    ``resolve()`` returns the dict (blocking on a Future); ``subscribe(callback)`` calls back with it when it is
    there; ``update(other)`` merges more values (after the Future, if pending); ``m[key]``, ``len(m)``, ``iter(m)``
    resolve first.
    """

    def __init__(self, inner: Union[Dict[str, Any], "Future[Dict[str, Any]]"]) -> None:
        if isinstance(inner, Future):
            self._future: Optional[Future] = inner
            self._data: Dict[str, Any] = {}
            self._resolved = False
        else:
            self._future = None
            self._data = dict(inner)
            self._resolved = True

    def subscribe(self, callback: Callable[[Dict[str, Any]], None], on_error: Optional[Callable[[Exception], None]] = None) -> None:
        if self._resolved:
            callback(self._data)
            return
        assert self._future is not None

        def done(future: Future) -> None:
            try:
                self._data, self._resolved = future.result(), True
            except Exception as error:  # handed to on_error, else raised in the Future's callback thread
                if on_error is None:
                    raise
                on_error(error)
                return
            callback(self._data)

        self._future.add_done_callback(done)

    def resolve(self) -> Dict[str, Any]:
        if not self._resolved:
            assert self._future is not None
            self._data, self._resolved = self._future.result(), True
        return self._data

    def update(self, other: Union[Dict[str, Any], "DeferrableMetrics"]) -> None:  # type: ignore[override]
        if isinstance(other, DeferrableMetrics):
            if other.is_resolved():
                self.update(other._data)
            else:
                other.subscribe(self.update)
            return
        if not isinstance(other, dict):
            raise TypeError(f"DeferrableMetrics.update takes a dict or a DeferrableMetrics, got {type(other).__name__}")
        host, event = transfer_tensors_to_cpu(other)
        if self._resolved:
            if event is not None:
                event.synchronize()
            self._data.update(host)
            return
        assert self._future is not None
        merged: Future = Future()

        def merge(future: Future) -> None:
            try:
                if event is not None:
                    event.synchronize()
                result = dict(future.result())
                result.update(host)
                merged.set_result(result)
            except Exception as error:  # the merged Future carries the original's failure
                merged.set_exception(error)

        self._future.add_done_callback(merge)
        self._future = merged

    def is_resolved(self) -> bool:
        return self._resolved

    def __bool__(self) -> bool:  # an empty result is still a result (``metrics or {}`` must not replace it)
        return True

    def __setitem__(self, key: str, value: Any) -> None:
        self.resolve()[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.resolve())

    def __len__(self) -> int:
        return len(self.resolve())

    def __repr__(self) -> str:
        return f"DeferrableMetrics(resolved, {len(self._data)} keys)" if self._resolved else "DeferrableMetrics(pending)"
