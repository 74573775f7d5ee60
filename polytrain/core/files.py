"""Replacing a small file so readers see the old content or the new, never a mix.

The new content goes to a temporary file beside the target, then ``os.replace`` moves it over. The
temporary name is unique to the writer: two runs, or two ranks, writing the same target
never share one, so neither can rename the other's half-written file away.
"""

from __future__ import annotations

import contextlib
import os
import uuid


def temporary_sibling(path: str) -> str:
    """A hidden name next to ``path`` that no other writer uses (for ``os.link`` and the like)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")


def replace_text(path: str, text: str, durable: bool = False) -> None:
    """Write ``text`` to ``path`` atomically. ``durable``: fsync before the rename, so the new content
    survives a power cut once ``path`` names it."""
    tmp = temporary_sibling(path)
    # Created exclusively, with the permissions the user's umask gives new files (mkstemp's are 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
