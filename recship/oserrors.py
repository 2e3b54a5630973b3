"""One line for a failed file operation (a full disk, a read-only folder, a file that vanished): every command's
OSError becomes ``recship CMD: error: PATH: CAUSE (WHAT WAS BEING DONE)`` and exit code 2 in ``recship.cli``.

Code that writes or reads files does not catch OSError itself; where the error would not say which file or what
for (``file.write`` raises ENOSPC without a file name), it runs inside ``doing(what, path)``, which labels the error
on its way up. ``no_space`` is the ENOSPC of a known size: how much was needed and how much is free, on which
file system. ``carry`` and ``carried`` take an OSError out of a spawned training rank, whose parent sees only its
traceback's text.
"""

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]
_DOING = "recship_doing"  # the attribute ``doing`` sets on an OSError: what was being done


@contextmanager
def doing(what: str, path: Optional[PathLike] = None) -> Iterator[None]:
    """Labels an OSError raised inside with ``what`` was being done and, if it names no file, with ``path``.
    The innermost label wins: it is the most precise."""
    try:
        yield
    except OSError as e:
        label(e, what, path)
        raise


def label(e: OSError, what: str, path: Optional[PathLike] = None) -> OSError:
    """``e`` labelled as ``doing`` labels it (an earlier label and file name are kept); returns ``e``."""
    if getattr(e, _DOING, None) is None:
        setattr(e, _DOING, what)
    if e.filename is None and path is not None and e.strerror is not None:  # (a message alone stays as it is)
        e.filename = os.fspath(path)
    return e


def one_line(e: OSError) -> str:
    """``PATH: CAUSE (WHAT)``: the file (both, for a rename), the system's words for the errno, what was being done.
    An OSError made with a message alone (``FileNotFoundError("checkpoint not found: x")``) is that message."""
    if e.strerror is None:
        return str(e)
    where = "" if e.filename is None else f"{os.fsdecode(e.filename)}: "
    if e.filename2 is not None:
        where = f"{os.fsdecode(e.filename)} -> {os.fsdecode(e.filename2)}: "
    what = getattr(e, _DOING, None)
    return where + e.strerror + (f" ({what})" if what else "")


_CARRIED = "recship.oserrors.carry: "  # the start of ``carry``'s line


def carry(e: OSError) -> str:
    """``e`` as one line of text that survives a spawned process's traceback (torch.multiprocessing hands the parent
    only that text): the marker, then errno, cause, files and label as JSON. ``carried`` reads it back."""
    files = [None if f is None else os.fsdecode(f) for f in (e.filename, e.filename2)]
    return _CARRIED + json.dumps([e.errno, e.strerror, *files, getattr(e, _DOING, None)])


def carried(text: str) -> Optional[OSError]:
    """The OSError the last ``carry`` line in ``text`` holds (a subclass by its errno, as Python makes them), or None."""
    start = text.rfind(_CARRIED)
    if start < 0:
        return None
    number, cause, filename, filename2, what = json.loads(text[start + len(_CARRIED):].splitlines()[0])
    e = OSError(number, cause, filename, None, filename2)
    if what is not None:
        setattr(e, _DOING, what)
    return e


def write_bytes(path: PathLike, data: Union[bytes, memoryview], what: str) -> None:
    """Writes ``data`` to the file ``path``; a full disk is ``no_space`` (the bytes needed and free), labelled ``what``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise label(no_space(path, len(data)), what) from None
        raise label(e, what, path)


def no_space(path: PathLike, needed: int) -> OSError:
    """The ENOSPC of writing ``needed`` more bytes to ``path``: names the file system (its mount point) and the
    bytes needed and free on it."""
    folder = Path(path).parent
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    cause = f"{os.strerror(errno.ENOSPC)}: {_size(needed)} needed, {_size(free)} free on {mount_point(folder)}"
    return OSError(errno.ENOSPC, cause, os.fspath(path))


def mount_point(path: PathLike) -> str:
    """The mount point of the file system ``path`` lies on."""
    p = Path(os.path.realpath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def _size(n: int) -> str:
    """Bytes as people read them, exact below 1 KiB: 512 B, 3.2 MiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")
