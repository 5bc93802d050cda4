"""Writing a file the user named (``-o``, a converted model, an artifact):
all of it or nothing, never over a device or a directory, and errors that
name the user's path, not a temporary one.

All of it or nothing: the bytes go to a temporary file beside the target,
renamed over it once complete (a full disk or a crash leaves the old file,
or none). Never over something that is not a regular file: a rename over
``/dev/full`` replaced the device node with the artifact.
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import IO, Iterator


def check_output(path: str | os.PathLike) -> None:
    """Raise OSError (naming ``path``) when ``path`` cannot take a new file:
    an existing non-regular file, or a folder that does not exist."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise OSError(errno.ENOENT, "no such folder to write into", path) from None
        return
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    if stat.S_ISDIR(st.st_mode):
        raise OSError(errno.EISDIR, "is a directory; give a file name", path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "exists and is not a regular file (a device, pipe or socket); "
                                    "give a file name", path)


def temp_beside(path: str | os.PathLike) -> str:
    """A temporary name beside ``path``, private to this process and thread."""
    import threading

    return f"{os.fspath(path)}.{os.getpid()}.{threading.get_ident() % 100000}.part"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary name beside ``path`` for a writer to create; it becomes
    ``path`` when the block ends without an error, and is removed when one
    is raised (an OSError is raised again naming ``path``). For writers that
    open the file themselves; ``atomic_output`` opens it."""
    path = os.fspath(path)
    check_output(path)
    tmp = temp_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        discard(tmp)
        named = naming(e, path)
        if named is e:
            raise
        raise named from None


@contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """A file to write ``path``'s new content into (``atomic_path``), closed
    before it is renamed."""
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """All of ``data`` at ``path``, or nothing (``atomic_output``)."""
    text = isinstance(data, str)
    with atomic_output(path, "w" if text else "wb", encoding="utf-8" if text else None) as f:
        f.write(data)


def naming(e: BaseException, path: str | os.PathLike) -> BaseException:
    """What a writer raises when writing ``path`` failed: an OSError again,
    naming ``path`` instead of the temporary file it was writing; anything
    else as it is."""
    if isinstance(e, OSError) and not isinstance(e, (BrokenPipeError, InterruptedError)):
        return OSError(e.errno, e.strerror, os.fspath(path))
    return e


def discard(path: str) -> None:
    """Remove a temporary file if it is there."""
    try:
        os.remove(path)
    except OSError:
        pass
