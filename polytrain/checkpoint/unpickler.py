"""Reading a DCP checkpoint without ever unpickling arbitrary objects.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and its load planner reads
non-tensor entries with ``weights_only=False``: a crafted checkpoint could run code. Here
``.metadata`` goes through an allow-list of DCP's metadata classes and non-tensor entries through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from polytrain.core import lazy

METADATA_FILE = ".metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's ``Metadata`` and nothing else: a crafted ``.metadata`` cannot run code."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's {METADATA_FILE}: "
                                     f"only DCP metadata classes are allowed")


def safe_reader(path: str) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose metadata read is restricted as above."""
    dcp = lazy.dcp()
    Metadata, StorageMeta = dcp.metadata.Metadata, dcp.metadata.StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            with open(os.path.join(path, name), "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{METADATA_FILE} holds a {type(metadata).__name__}, "
                                             "not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor entries load with ``weights_only=True`` (DCP's own
    planner uses ``weights_only=False``). The checked object is handed on re-serialised."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)  # type: ignore[misc]


def safe_load_planner(empty: bool) -> Any:
    """A DCP load planner (``empty``: one that fills an empty dict with everything saved)."""
    planners = lazy.dcp().default_planner
    base = planners._EmptyStateDictLoadPlanner if empty else planners.DefaultLoadPlanner
    return type("SafeLoadPlanner", (_WeightsOnlyBytes, base), {})()
