"""What clients give, read the same way wherever it arrives: their strings as messages show them, and their
numbers (ids, weights, dense values) as the REST front reads JSON tensors.

Kept free of torch and grpc: the Python client (``PredictClient``, ``recship predict``) refuses exactly what
the REST front refuses, in its words, before sending anything, and imports only this. recship_predict's JSON
reader (cpp_loader/tools/recship_predict.cpp) says the same words (tests/cpp_loader/test_cpp_predict_json.py).
"""

import sys
from typing import Any, Optional, Sequence

INT_RANGE = {"INT32": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1)}
_DOUBLE_MAX = int(sys.float_info.max)


def shown(text: object, limit: int = 64) -> str:
    """A client's string for a message or a log line: quoted with control characters escaped, cut to ``limit``.

    Echoing names in full lets a client make the answer exceed gRPC's metadata limit.
    """
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def number_error(name: str, datatype: str, values: Sequence[Any]) -> Optional[str]:
    """Why the flat ``values`` of input ``name`` cannot be a ``datatype`` tensor ("INT32", "INT64", "FP32"), or None.

    Strict, as JSON gives them: integer types take ints within their range (no 1.5, 1.0, "1" or true), FP32 takes
    ints and floats (no booleans or strings); nothing is truncated or coerced. (Finiteness is validation's:
    "dense values must be finite".)
    """
    kinds = set(map(type, values))
    allowed = {int} if datatype in INT_RANGE else {int, float}
    if not kinds <= allowed:
        wrong = sorted(k.__name__ for k in kinds - allowed)
        return f"input {shown(name)}: {datatype} data must be {' or '.join(sorted(a.__name__ for a in allowed))}s, found {', '.join(wrong)}"
    if datatype in INT_RANGE and values:
        lo, hi = INT_RANGE[datatype]
        if min(values) < lo or max(values) > hi:
            return f"input {shown(name)}: a value is outside {datatype}'s range"
    if int in kinds and datatype not in INT_RANGE and any(type(v) is int and abs(v) > _DOUBLE_MAX for v in values):
        return f"input {shown(name)}: a value is outside {datatype}'s range"  # (an int with no float at all)
    return None
