"""KServe REST JSON read with its large number arrays straight into numpy, and what reading a body will cost.

``json.loads`` turns a list of 13M ids into 13M list slots (8 bytes each) plus an int object for every id past
256 (28 bytes): a 24.9 MiB body cost the server ~516 MiB once it had gone through a list, a protobuf and arrays.
Here a flat array of numbers of at least ``FAST_CHARS`` characters is matched by one regular expression and
parsed by ``np.fromstring`` into one array (8 bytes a value), held as ``Numbers``; everything else (the request's
objects, short arrays, arrays holding anything but numbers) goes through the standard parser, unchanged.

``Body`` bounds, before anything is decoded, the bytes decoding a body holds at its peak (the text, the fast
arrays, the standard parser's objects at their worst) and the tensors it holds, which the REST front charges to
the in-flight budget (--max-inflight-mb, ``serving/footprint.py``): a request that does not fit is refused
before it is decoded.

The fast path says what the standard one would: the same syntax errors at the same character, and for a
``data`` array the same verdict of ``values.number_error`` (``Numbers.sample`` is a short list with the same
kinds, least and greatest integer).
"""

import io
import json
import re
from json import scanner as json_scanner
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

FAST_CHARS = 256  # a shorter array goes through the standard parser: its few objects cost little
SLOW_BYTES_PER_CHAR = 24  # the standard parser's worst: "{}," is a 64-byte dict for 3 characters, "[1]," 64 for 4
VALUE_BYTES = 8  # a fast array's values as int64 or float64

_SPAN = re.compile(r"\[[-+0-9.eE, \t\n\r]*\]")  # a candidate: '[', number characters and JSON whitespace, ']'
_SPAN_BYTES = re.compile(_SPAN.pattern.encode())
_NUM = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # JSON's number (the standard parser's NUMBER_RE)
_WS = "[ \t\n\r]"
# What makes number characters, commas and JSON whitespace not a JSON list of numbers, each rule matching in the one
# value (or at the comma) where it goes wrong. _NOT_JSON is all of them (for an error's place); _QUICK are those
# np.fromstring would let through (it stops with ValueError at the rest), each a pattern the regular expression
# engine searches for quickly: _NOT_JSON's search takes 6.5 s for 13M ids, _QUICK's 0.2 s.
_NOT_JSON = re.compile("|".join([
    rf"^{_WS}*,", rf",{_WS}*,", rf",{_WS}*$",  # a missing value
    r"(?<![eE])\+", r"(?<=[^eE, \t\n\r])-", r"-(?![0-9])",  # a sign out of place
    r"(?<![0-9])\.", r"\.(?![0-9])", r"\.[0-9]+\.", r"[eE][-+]?[0-9]+[.eE]",  # a point or an exponent out of place
    r"(?<![0-9])[eE]", r"[eE](?![-+]?[0-9])",
    r"(?<![0-9.eE+-])-?0[0-9]",  # a leading zero
    rf"[0-9]{_WS}+[-0-9]",  # two values without a comma
]))
_QUICK = [re.compile(p) for p in (rf",{_WS}*,", r"-(?![0-9])", rf"[,{_WS[1:-1]}]-?0[0-9]", r"^-?0[0-9]", r"\.(?![0-9])", r"[^0-9]\.", r"^\.")]
_PLUS = re.compile(r"(?<![eE])\+")
_CHUNK = 1 << 20  # characters: where np.fromstring refused, the error is looked for a chunk at a time
_NOT_INT = re.compile(r"[.eE]")
_LONG_INT = re.compile(r"-?[0-9]{19,}")  # may be outside int64 (checked one at a time)
_TOKEN = re.compile(_NUM)
_DOUBLE_DIGITS = 309  # an int of more digits is past the largest double


def spans(text: str) -> List[Tuple[int, int]]:
    """(start, end) of each array the fast path takes: '[' to its ']' inclusive, at least FAST_CHARS long."""
    return [(m.start(), m.end()) for m in _SPAN.finditer(text) if m.end() - m.start() >= FAST_CHARS]


class Body:
    """A JSON body, and what decoding it will hold (``held``, ``tensor_bytes``), known from a scan of its bytes before
    anything is decoded (not even its text); then ``loads``."""

    def __init__(self, body: bytes, parse_constant: Callable[[str], Any]) -> None:
        self.body, self.parse_constant = body, parse_constant  # parse_constant: what NaN, Infinity raise
        self.nbytes = len(body)
        # (the fast arrays are ASCII: in UTF-8 they are the same characters at other offsets, in UTF-16 or -32 none)
        found = [(m.start(), m.end()) for m in _SPAN_BYTES.finditer(body) if m.end() - m.start() >= FAST_CHARS]
        self.fast_values = sum(body.count(b",", start, end) + 1 for start, end in found)
        self.slow_chars = len(body) - sum(end - start for start, end in found)

    def held(self) -> int:
        """An upper bound of the bytes decoding holds at its peak, past the body: its text, each fast array's values,
        and SLOW_BYTES_PER_CHAR for every other character (the standard parser's objects)."""
        text = self.nbytes * (1 if self.body.isascii() else 4)
        return text + VALUE_BYTES * self.fast_values + SLOW_BYTES_PER_CHAR * self.slow_chars

    def tensor_bytes(self) -> int:
        """An upper bound of the bytes of the numbers it holds, as int64 or float64: each of the fast arrays, and one
        for every 2 other characters (a digit and a comma)."""
        return VALUE_BYTES * self.fast_values + VALUE_BYTES * (self.slow_chars + 1) // 2

    def loads(self) -> Any:
        """``json.loads`` of the body, strict (NaN and Infinity go to ``parse_constant``), with every array of ``spans``
        as ``Numbers``. Raises ValueError (json.JSONDecodeError; UnicodeDecodeError) as json.loads does."""
        text = self.body.decode(json.detect_encoding(self.body), "surrogatepass")  # as json.loads(bytes) reads it
        fast = spans(text)
        if not fast:  # nothing to read fast: the standard parser in C
            return json.JSONDecoder(parse_constant=self.parse_constant).decode(text)
        return _Decoder(fast, self.parse_constant).decode(text)


class Numbers:
    """A flat JSON array of numbers, parsed into one array.

    values: [n] int64 when every number is an integer within int64, else float64 (Python's float() of each)
    ints: every number is a JSON integer
    sample: a few Python numbers whose kinds, least and greatest integer and integers past a double are those of
    the whole array (all that ``values.number_error`` looks at)
    text: the array's JSON text (for an error message, or a short array back to a list)
    """

    def __init__(self, values: np.ndarray, ints: bool, sample: List[Any], text: str) -> None:
        self.values, self.ints, self.sample, self.text = values, ints, sample, text

    def __len__(self) -> int:
        return int(self.values.size)

    def to_list(self) -> list:
        """The list the standard parser gives (for a short array: a shape, a parameter)."""
        return json.loads(self.text)

    def __str__(self) -> str:
        """str() of the list (what a message shows, cut), built a slice at a time: json.dumps of it too."""
        out = io.StringIO()
        out.write("[")
        if self.ints and self.values.dtype != np.int64:  # integers past int64: from the text
            items: Iterator[str] = (str(int(m.group())) for m in _TOKEN.finditer(self.text))
            out.write(", ".join(items))
        elif self.ints:
            for start in range(0, self.values.size, 65536):
                out.write((", " if start else "") + ", ".join(map(str, self.values[start:start + 65536].tolist())))
        else:  # integers and floats: each as the standard parser reads it
            out.write(", ".join(repr(float(t)) if _NOT_INT.search(t) else str(int(t)) for t in map(re.Match.group, _TOKEN.finditer(self.text))))
        out.write("]")
        return out.getvalue()

    __repr__ = __str__


class _Decoder(json.JSONDecoder):
    """The standard decoder on its pure-Python scanner (whose parse_array can be replaced), with fast arrays."""

    def __init__(self, fast: List[Tuple[int, int]], parse_constant) -> None:
        super().__init__(parse_constant=parse_constant)
        stops = dict(fast)
        standard: Callable[..., Tuple[Any, int]] = getattr(json.decoder, "JSONArray")  # (what parse_array is by default)

        def parse_array(state: Tuple[str, int], scan_once) -> Tuple[Any, int]:
            s, end = state  # end: just past '['
            stop = stops.get(end - 1)
            if stop is None:
                return standard(state, scan_once)
            return _numbers(s, end - 1, stop, scan_once), stop

        self.parse_array = parse_array
        self.scan_once = getattr(json_scanner, "py_make_scanner")(self)  # the pure-Python scanner: it calls parse_array


def _numbers(s: str, start: int, stop: int, scan_once) -> Numbers:
    """The array s[start:stop] ('[' number characters ']') as Numbers, or the standard parser's error."""
    inner = s[start + 1:stop - 1]
    ints = _NOT_INT.search(inner) is None
    wrong = _quick_error(inner, ints)
    if wrong is not None:  # not JSON: the standard parser says why, from the value that goes wrong
        _raise_at(s, start, start + 1 + _error_at(inner, wrong), scan_once)
    count = inner.count(",") + 1 if inner.strip(" \t\n\r") else 0
    try:
        values = np.fromstring(inner, dtype=np.int64 if ints else np.float64, sep=",", count=count)
    except ValueError:  # two values without a comma, an exponent out of place: find where
        _raise_at(s, start, start + 1 + _error_at(inner, len(inner)), scan_once)
    last = inner.rfind(",") + 1
    wrong_last = _NOT_JSON.search(inner, last)  # np.fromstring stops at the count: what follows the last value
    if wrong_last is not None:
        _raise_at(s, start, start + 1 + _error_at(inner, wrong_last.start()), scan_once)
    assert values.size == count, (values.size, count)
    sample: List[Any]
    if ints:
        lo, hi = (int(values.min()), int(values.max())) if count else (None, None)
        if lo is not None and hi is not None and (lo == -(2**63) or hi == 2**63 - 1):  # np.fromstring saturates
            lo, hi = _long_int_range(inner, lo, hi)
            if lo < -(2**63) or hi > 2**63 - 1:
                values = np.fromstring(inner, dtype=np.float64, sep=",", count=count)
        sample = [v for v in (lo, hi) if v is not None]
    else:
        sample = [0.5] + _ints_of_mixed(inner, values)
    return Numbers(values, ints, sample, s[start:stop])


def _quick_error(inner: str, ints: bool) -> Optional[int]:
    """Where ``inner`` breaks a rule np.fromstring does not check, or None."""
    edge = inner.strip(" \t\n\r")
    found = [m.start() for m in (p.search(inner) for p in _QUICK) if m is not None]
    if edge.startswith(","):
        found.append(inner.index(","))
    if edge.endswith(","):
        found.append(inner.rindex(","))
    if "+" in inner:
        m = re.search(r"\+", inner) if ints else _PLUS.search(inner)
        if m is not None:
            found.append(m.start())
    return min(found) if found else None


def _error_at(inner: str, known: int) -> int:
    """Where in ``inner`` the first value that is not JSON is, given one at ``known`` (len(inner): np.fromstring
    refused it, somewhere): the first chunk of whole values that np.fromstring refuses or that holds ``known``,
    searched with every rule (the search of all of ``inner`` would take seconds)."""
    begin = 0
    while True:
        end = inner.find(",", begin + _CHUNK)
        end = len(inner) if end < 0 else end
        chunk = inner[begin:end]
        if begin <= known <= end:
            refused = True
        else:
            try:
                np.fromstring(chunk, dtype=np.float64, sep=",", count=chunk.count(",") + 1)
                refused = False
            except ValueError:
                refused = True
        m = _NOT_JSON.search(chunk) if refused else None
        if m is not None or end >= len(inner):
            return begin + m.start() if m is not None else known
        begin = end + 1


def _long_int_range(inner: str, lo: int, hi: int) -> Tuple[int, int]:
    """(least, greatest) of ``lo``, ``hi`` and the integers of 19 digits or more; one Python int alive at a time."""
    for m in _LONG_INT.finditer(inner):
        v = int(m.group())
        lo, hi = min(lo, v), max(hi, v)
    return lo, hi


def _ints_of_mixed(inner: str, values: np.ndarray) -> List[int]:
    """For an array with non-integers: an integer if it has any, and its integers past a double; "-0" read as the
    integer 0 (float64 -0.0 from np.fromstring) is made +0.0 in ``values``."""
    out: List[int] = []
    index = 0
    at = 0
    for m in _TOKEN.finditer(inner):
        token = m.group()
        index += inner.count(",", at, m.start())
        at = m.start()
        if _NOT_INT.search(token):
            continue
        if not out or len(token) >= _DOUBLE_DIGITS:
            out.append(int(token))
        if token == "-0":
            values[index] = 0.0
    return out


def _raise_at(s: str, start: int, bad: int, scan_once) -> None:
    """Raises the standard parser's error for the array at ``start`` whose text stops being JSON in the value (or at
    the comma) at ``bad``: it parses from the start of that value, after the comma before it (everything before is
    values and commas), so the message and position are the standard's, for the cost of a few characters."""
    comma = s.rfind(",", start + 1, bad)
    resume = start + 1 if comma < 0 else comma + 1
    while resume < bad and s[resume] in " \t\n\r":
        resume += 1
    getattr(json.decoder, "JSONArray")((s, resume), scan_once)
    raise json.JSONDecodeError("Expecting ',' delimiter", s, bad)  # a safety net: the standard parser raised
