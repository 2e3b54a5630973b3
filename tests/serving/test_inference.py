"""The core's error kinds: what each exception is, the status label it is counted under, and every front's table."""

import asyncio

import grpc
import pytest

from recship.serving.batcher import DeadlineExpired, QueueFull, Unloaded, WorkerDied
from recship.serving.grpc_status import CODES
from recship.serving.inference import MAX_MESSAGE_CHARS, ClientTimeout, ErrorKind, Overloaded, error_of
from recship.serving.repository import ControlRefused, ModelNotFound
from recship.serving.requests import IdOutOfRange, InvalidRequest, RequestTooLarge
from recship.serving.rest import HTTP_STATUS

# exception -> (kind, metrics status label, gRPC code, HTTP status): what clients and dashboards see
CASES = [
    (InvalidRequest("bad"), ErrorKind.INVALID, "INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT, 400),
    (IdOutOfRange("id 9 is out of range"), ErrorKind.INVALID, "INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT, 400),
    (RequestTooLarge("big"), ErrorKind.TOO_LARGE, "INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT, 413),
    (ModelNotFound("nope"), ErrorKind.NOT_FOUND, "NOT_FOUND", grpc.StatusCode.NOT_FOUND, 404),
    (QueueFull("full"), ErrorKind.OVERLOADED, "RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (Overloaded("bytes"), ErrorKind.OVERLOADED, "RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (WorkerDied("died"), ErrorKind.UNAVAILABLE, "UNAVAILABLE", grpc.StatusCode.UNAVAILABLE, 503),
    (Unloaded("gone"), ErrorKind.UNAVAILABLE, "UNAVAILABLE", grpc.StatusCode.UNAVAILABLE, 503),
    (DeadlineExpired("late"), ErrorKind.DEADLINE, "DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (asyncio.TimeoutError(), ErrorKind.DEADLINE, "DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (ClientTimeout("slow body"), ErrorKind.CLIENT_TIMEOUT, "DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED, 408),
    (asyncio.CancelledError(), ErrorKind.CANCELLED, "CANCELLED", grpc.StatusCode.CANCELLED, 500),
    (ControlRefused("polling"), ErrorKind.REFUSED, "FAILED_PRECONDITION", grpc.StatusCode.FAILED_PRECONDITION, 400),
    (KeyError("x"), ErrorKind.INTERNAL, "INTERNAL", grpc.StatusCode.INTERNAL, 500),
]


@pytest.mark.parametrize("error, kind, label, code, http", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_each_error_has_one_kind_and_every_front_maps_it(error, kind, label, code, http):
    assert error_of(error)[0] is kind
    assert (kind.label, CODES[kind], HTTP_STATUS[kind]) == (label, code, http)


def test_every_front_maps_every_kind():
    assert set(CODES) == set(ErrorKind) == set(HTTP_STATUS)


def test_messages():
    assert error_of(InvalidRequest("bad field"))[1] == "bad field"
    assert error_of(asyncio.TimeoutError())[1] == "deadline exceeded"
    assert error_of(asyncio.CancelledError())[1] == "cancelled by the client"
    assert error_of(KeyError("x"))[1] == "KeyError: 'x'"
    long = error_of(InvalidRequest("m" * (MAX_MESSAGE_CHARS + 50)))[1]
    assert long == "m" * MAX_MESSAGE_CHARS + "..."
