"""A checkpoint is complete only when verified: every byte checked against a checksum written last.

- A checkpoint file is ``torch.save``'s zip archive. Its central directory, written last, lists every
  record (the pickle, each tensor's bytes) with its size and CRC-32: that directory is the file's
  manifest. ``verify_file`` reads every record once against its CRC. A truncated file has no central
  directory; a flipped bit fails its record's check. ``torch.load`` checks neither, so a damaged file
  would load silently. Any torch zip file is checked this way, a plain loop's or Lightning's too.
- A sharded (DCP) directory gets ``manifest.json``: every file's size and CRC-32, each computed by the
  rank that wrote the file right after DCP wrote it (still in that node's page cache), gathered and
  written by global rank 0 as the last file before the directory is renamed into place.
  ``verify_directory`` checks the sizes (a truncated or missing shard) and the checksums (a zeroed or
  random one of the right size), over the files it is given: a load spreads them over the ranks.

Checking costs one read of the checkpoint (CRC-32 runs at a few GB/s): at a save only for sharded
directories (files carry theirs from ``torch.save``), at every load, and when ``resume: last`` chooses.
Directories written before manifests existed are taken as complete when DCP's ``.metadata`` and the
payload are present, as before.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from typing import Any

from polytrain.core.errors import CheckpointError
from polytrain.core.files import replace_text

MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 22
_ZIP_MAGIC = b"PK\x03\x04"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def crc32_of(path: str) -> dict[str, int]:
    """``{"size": bytes, "crc32": checksum}`` of one file."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def verify_file(path: str) -> None:
    """Raise ``CheckpointError`` unless every record of the checkpoint file matches its CRC-32. A file in
    torch's legacy (non-zip) format has no checksums: left to ``torch.load``."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                return
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as record:
                    while record.read(_CHUNK):
                        pass
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as err:
        why = f"{err} (torch's zip records fail their size or CRC-32 check)"
        raise damaged(f"checkpoint {path}", why) from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror or err}") from None


def files_written_by(directory: str, rank: int, world_size: int) -> list[str]:
    """The files of a DCP directory that ``rank`` checksums: the shards DCP names after it
    (``__<rank>_<n>.distcp``); global rank 0 also takes every other file (``.metadata``, the payload)."""
    names = []
    for name in sorted(os.listdir(directory)):
        skipped = name.startswith(".tmp-") or name == MANIFEST_FILE
        if skipped or not os.path.isfile(os.path.join(directory, name)):
            continue
        match = _SHARD.match(name)
        owner = int(match.group(1)) if match and int(match.group(1)) < world_size else 0
        if owner == rank:
            names.append(name)
    return names


def checksums(directory: str, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: crc32_of(os.path.join(directory, name)) for name in names}


def write_manifest(directory: str, entries: dict[str, dict[str, int]]) -> None:
    """Global rank 0, once every file of the directory is written: the manifest goes in last."""
    text = json.dumps({"format": 1, "files": dict(sorted(entries.items()))}, indent=1)
    replace_text(os.path.join(directory, MANIFEST_FILE), text, durable=True)


def read_manifest(directory: str) -> dict[str, dict[str, int]] | None:
    """The files a directory's manifest lists (None: written before manifests existed)."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data: Any = json.load(fh)
        files = data["files"]
        return {str(k): {"size": int(v["size"]), "crc32": int(v["crc32"])} for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        why = f"its {MANIFEST_FILE} cannot be read ({err})"
        raise damaged(f"sharded checkpoint {directory}", why) from None


def verify_directory(directory: str, part: tuple[int, int] = (0, 1), sums: bool = True) -> None:
    """Raise ``CheckpointError`` unless the files the manifest lists are there with their sizes and (with
    ``sums``) checksums. ``part=(i, n)``: only every n-th file from the i-th, so n ranks share the reading."""
    manifest = read_manifest(directory)
    if manifest is None:
        return
    index, count = part
    for name in sorted(manifest)[index::count]:
        expected, path = manifest[name], os.path.join(directory, name)
        where = f"sharded checkpoint {directory}"
        try:
            size = os.path.getsize(path)
        except OSError:
            raise damaged(where, f"{name} is missing") from None
        if size != expected["size"]:
            raise damaged(where, f"{name} holds {size} bytes, its manifest says {expected['size']}")
        if sums and crc32_of(path)["crc32"] != expected["crc32"]:
            raise damaged(where, f"{name} fails its CRC-32 check")


def damaged(what: str, why: str) -> CheckpointError:
    return CheckpointError(f"{what} is damaged: {why}. Load an older checkpoint; resume: last skips "
                           f"damaged ones")
