"""A model repository's layout: ``<root>/<model>/<version>/`` artifact folders, a version named by its number in ASCII
digits. ``version_folders`` reads a model's versions as a server scans them; ``publish_version`` puts a finished
artifact there as the next version, atomically (export's ``--repo``); ``exchange`` swaps a folder for another
(``--overwrite``). Names starting with "." are a version being written: scans skip them.
"""

import ctypes
import errno
import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

# A model's name (a repository folder, a served model) and a version's (an ASCII number, below 10**18)
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
VERSION_NAME = re.compile(r"[0-9]{1,18}")

__all__ = ["MODEL_NAME", "VERSION_NAME", "RepositoryError", "exchange", "next_version", "parse_version", "publish_version",
           "version_folders"]


class RepositoryError(ValueError):
    """A version that cannot be published (no number left)."""


def parse_version(name: str) -> Optional[int]:
    """The version a folder name stands for (1-18 ASCII digits), or None: "²", "1.0" and "latest" are none."""
    return int(name) if VERSION_NAME.fullmatch(name) else None


def version_folders(model_dir: Path) -> Tuple[List[Tuple[int, Path]], List[str]]:
    """(version, folder) of each version folder in ``model_dir``, newest first, and the names of the other folders
    (not versions: a server refuses them by name). Hidden folders (a version being written) are neither."""
    versions, others = [], []
    for entry in model_dir.iterdir():
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        version = parse_version(entry.name)
        if version is None:
            others.append(entry.name)
        else:
            versions.append((version, entry))
    return sorted(versions, reverse=True), sorted(others)


def next_version(model_dir: Path) -> int:
    """1 + the largest version in ``model_dir`` (1 if none, or no such folder); other names (hidden temporary
    folders, "latest", "²") do not count."""
    try:
        names = os.listdir(model_dir)
    except FileNotFoundError:
        return 1
    return 1 + max((v for v in map(parse_version, names) if v is not None), default=0)


def publish_version(tmp: Path, model_dir: Path, stamp: Callable[[int], None] = lambda version: None, attempts: int = 100) -> int:
    """Renames the finished artifact folder ``tmp`` (on ``model_dir``'s filesystem) to ``model_dir/<next
    version>``; returns the version. ``stamp(version)`` runs before each try (it writes the manifest).
    A number another export took first (the rename finds the folder there) is never overwritten:
    the next free number is tried instead."""
    version = next_version(model_dir)
    for _ in range(attempts):
        if parse_version(str(version)) is None:
            raise RepositoryError(f"{model_dir}: version {version} has more than 18 digits")
        stamp(version)
        try:
            _rename_noreplace(tmp, model_dir / str(version))
            return version
        except FileExistsError:  # a racing export (or a person) took this number: the next one
            version = max(version + 1, next_version(model_dir))
    raise RepositoryError(f"{model_dir}: no free version number after {attempts} tries")


@functools.lru_cache(maxsize=None)
def _renameat2() -> Optional[Any]:
    """libc's renameat2 (Linux, glibc 2.28+), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(a: Path, b: Path) -> None:
    """Swaps the folders ``a`` and ``b`` (same filesystem): atomic with renameat2(RENAME_EXCHANGE); where the
    OS or filesystem lacks it, ``b`` is renamed aside first, so it is missing only between two renames."""
    renameat2 = _renameat2()
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(b))
    aside = a.with_name(a.name + "-old")
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Renames ``src`` to ``dst``; FileExistsError if ``dst`` exists, even as an empty folder (which a
    plain rename would replace). Atomic with renameat2(RENAME_NOREPLACE); where the OS or filesystem
    lacks it, a check before the rename (a non-empty folder still makes the rename itself fail)."""
    renameat2 = _renameat2()
    if renameat2 is not None:
        at_fdcwd, rename_noreplace = -100, 1
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # EINVAL: this filesystem lacks the flag
            raise OSError(err, os.strerror(err), str(dst))  # EEXIST is a FileExistsError
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from e
        raise
