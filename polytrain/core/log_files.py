"""Text files a logger writes (``metrics.csv``, ``hparams.yaml``) and the version directories it
numbers, on a local path or at a URL (``s3://bucket/logs``, ``gs://...``, ``memory://...``), as
Lightning's loggers take either.

A local file is replaced atomically (``files.replace_text``). A URL is written through fsspec (which
torch installs; the protocol's own package, ``s3fs`` or ``gcsfs``, must be installed for it): an object
store uploads the whole file when it is closed, so a reader sees the old file or the new one there too.
Checkpoints never go to a URL: they rely on renames and hard links that object stores lack, so a run
whose logger writes to one keeps its checkpoints under ``default_root_dir``
(docs/migrating-from-lightning.md, the loggers' rows).
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from polytrain.core.files import replace_text

LOCAL_PROTOCOLS = ("file", "local")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a filesystem other than the local one (``s3://...``; not ``file://``)."""
    text = os.fspath(path)
    return "://" in text and text.split("://", 1)[0] not in LOCAL_PROTOCOLS


def _filesystem(url: str) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url)


def read_text(path: str) -> str | None:
    """The file's text, or None where there is no such file."""
    if not is_url(path):
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8", newline="") as fh:
            return fh.read()
    fs, inner = _filesystem(path)
    if not fs.isfile(inner):
        return None
    with fs.open(inner, "r", encoding="utf-8", newline="") as fh:
        return fh.read()


def write_text(path: str, text: str) -> None:
    """``path``'s content becomes ``text`` (its directory created): readers see the old or the new."""
    if not is_url(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        replace_text(path, text)
        return
    fs, inner = _filesystem(path)
    fs.makedirs(os.path.dirname(inner), exist_ok=True)
    with fs.open(inner, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)


def list_names(directory: str) -> list[str]:
    """The names in ``directory`` (none where it does not exist)."""
    if not is_url(directory):
        return os.listdir(directory) if os.path.isdir(directory) else []
    fs, inner = _filesystem(directory)
    if not fs.isdir(inner):
        return []
    return [os.path.basename(entry.rstrip("/")) for entry in fs.ls(inner, detail=False)]
