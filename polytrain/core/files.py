"""Replacing a file so readers see the old content or the new, never a mix.

The new content goes to a temporary file beside the target, then ``os.replace`` moves it over. The
temporary name is unique to the writer: two runs, or two ranks, writing the same target never share
one, so neither can rename the other's half-written file away. A write that fails removes its
temporary file and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any


def temporary_sibling(path: str) -> str:
    """A hidden name next to ``path`` that no other writer uses (for ``os.link`` and the like)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")


@contextlib.contextmanager
def replacing(path: str, binary: bool = False, durable: bool = False,
              temporary: str | None = None) -> Iterator[IO[Any]]:
    """A file to write ``path``'s new content into; it replaces ``path`` when the block ends without an
    error. ``durable``: fsync before the rename, so the new content survives a power cut once ``path``
    names it. ``temporary``: the temporary file's name (default: ``temporary_sibling(path)``)."""
    tmp = temporary or temporary_sibling(path)
    # Created exclusively, with the permissions the user's umask gives new files.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_text(path: str, text: str, durable: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (``replacing``)."""
    with replacing(path, durable=durable) as fh:
        fh.write(text)
