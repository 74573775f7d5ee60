"""Hugging Face model directories in and out: a module's ``PreTrainedModel`` filled from a local directory
(``trainer.init_weights``) after the strategy placed or sharded it, and any checkpoint written out as such a
directory (``polytrain checkpoint export CKPT OUT --format hf``).

A directory is what ``save_pretrained`` writes: ``config.json`` and the weights as safetensors, one
``model.safetensors`` or several files listed by ``model.safetensors.index.json``. Keys are the model's own
``state_dict`` names; a tied weight (GPT-2's head, tied to its embedding) is stored once, under the name it
is tied to. Loading reads through safetensors' slices, so each rank reads only the part of each tensor it
holds: its FSDP shard, its tensor-parallel slice, its pipeline stages' layers. Export reads a sharded
checkpoint one tensor at a time and writes one output file at a time, so it never holds more than one
output file's worth beyond one tensor.

A checkpoint records what export needs (``pretrained_records``): where each model sits in the module, its
class, its config as JSON text and its ties. A model defined in a script cannot be rebuilt from its config,
so the export never builds one: it writes the tensors under the model's names beside the config.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polytrain.checkpoint.reading import check_complete, quiet_single_process, read_checkpoint, read_meta
from polytrain.checkpoint.state import Parts, part_state
from polytrain.checkpoint.unpickler import safe_load_planner, safe_reader
from polytrain.core import collectives as C
from polytrain.core import lazy
from polytrain.core.errors import CheckpointError, ConfigError, first_few

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
RECORD_KEY = "hugging_face"  # the checkpoint payload's entry (pretrained_records)
DEFAULT_SHARD_BYTES = 5 * 1024**3  # save_pretrained's default max_shard_size, 5 GB
# What wrappers insert into a module path (torch.compile, activation checkpointing, FSDP1, DDP): the names
# a checkpoint uses leave them out, and so does the record of where the model sits.
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _safetensors() -> tuple[Callable[..., Any], Callable[..., None]]:
    """safetensors' ``safe_open`` and ``save_file``: the ``hf`` extra's one dependency."""
    try:
        import safetensors.torch  # late: the hf extra, asked for by init_weights and export only
    except ImportError:
        raise ConfigError("Hugging Face directories are read and written with safetensors, which is not "
                          "installed: pip install 'polytrain[hf]' (or pip install safetensors)") from None
    return safetensors.safe_open, safetensors.torch.save_file


# --------------------------------------------------------------------------- the model in the module


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (told by its classes: transformers need not
    be imported for a module that holds none)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def clean_path(name: str) -> str:
    """A module path as checkpoints name it: the segments wrappers insert left out."""
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_SEGMENTS)


def find_pretrained(module: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """``(path, model)``: the first ``PreTrainedModel`` in ``module`` (itself included), or the one at
    ``name``. The path is as checkpoints name it ("" when the module is the model)."""
    if name is not None:
        try:
            found = module.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"{type(module).__name__} has no submodule {name!r} to load or export as a "
                              f"Hugging Face model") from None
        if not is_pretrained_model(found):
            raise ConfigError(f"{type(module).__name__}.{name} is a {type(found).__name__}, not a Hugging "
                              f"Face PreTrainedModel")
        return clean_path(name), found
    for path, sub in module.named_modules():
        if is_pretrained_model(sub):
            return clean_path(path), sub
    raise ConfigError(f"{type(module).__name__} holds no Hugging Face PreTrainedModel (transformers' model "
                      f"classes), so there is nothing to fill from a Hugging Face directory or to export as "
                      f"one")


def within(model_path: str) -> Callable[[str], bool]:
    """Whether a module path (as ``named_modules`` gives it, wrappers' segments included) is the model at
    ``model_path`` or inside it."""

    def filled(path: str) -> bool:
        clean = clean_path(path)
        return not model_path or clean == model_path or clean.startswith(f"{model_path}.")

    return filled


def tied_weights(model: nn.Module) -> dict[str, str]:
    """The model's active ties, ``{tied name: the name it is tied to}``: what ``save_pretrained`` stores
    once, under the second name."""
    ties = getattr(model, "all_tied_weights_keys", None)
    if isinstance(ties, dict):
        return {str(k): str(v) for k, v in ties.items()}
    # transformers before 5: a list of the tied names, tied to the input embedding when the config says so
    names = getattr(model, "_tied_weights_keys", None) or []
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False) or not names:
        return {}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    source = next((f"{n}.weight" for n, m in model.named_modules() if m is embedding), None)
    return {str(k): source for k in names} if source is not None else {}


def pretrained_records(module: nn.Module) -> dict[str, dict[str, Any]]:
    """What an export needs of each ``PreTrainedModel`` the module holds (one inside another is part of
    it), by path in module order: its class, its config as ``config.json`` text and its ties. Plain types
    only; empty when it holds none."""
    records: dict[str, dict[str, Any]] = {}
    for name, model in module.named_modules():
        path = clean_path(name)
        if not is_pretrained_model(model) or any(within(outer)(path) for outer in records):
            continue
        config = model.config
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "{}"
        records[path] = {"path": path, "architecture": type(model).__name__.removeprefix("FSDP"),
                         "config": text, "tied": tied_weights(model)}
    return records


def pretrained_source(option: Any) -> tuple[str, str | None]:
    """``trainer.init_weights`` as ``(directory, model path or None: the first)``: a directory, or
    ``{path: DIR, model: attribute.path}`` naming which of the module's models it fills."""
    if isinstance(option, str):
        return option, None
    return str(option["path"]), (str(option["model"]) if option.get("model") is not None else None)


# --------------------------------------------------------------------------- reading a directory


class PretrainedDirectory:
    """A Hugging Face directory's tensors, read whole or by slice. ``elements_read`` counts what was read."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isdir(path):
            raise ConfigError(f"init_weights={path!r} is not a directory: give a local Hugging Face model "
                              f"directory (config.json and *.safetensors, as save_pretrained writes it)")
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            self.file_of = {str(k): str(v) for k, v in weight_map.items()}
        elif os.path.exists(os.path.join(path, WEIGHTS_NAME)):
            self.file_of = {}
            self._open_file(WEIGHTS_NAME)
        else:
            found = sorted(os.listdir(path))
            raise ConfigError(f"{path} holds neither {WEIGHTS_NAME} nor {INDEX_NAME} (it holds "
                              f"{first_few(found) if found else 'nothing'}): only safetensors weights are "
                              f"read; save the model with save_pretrained(..., safe_serialization=True)")
        self.elements_read = 0

    def _open_file(self, filename: str) -> Any:
        handles = self.__dict__.setdefault("_handles", {})
        if filename not in handles:
            safe_open, _ = _safetensors()
            handles[filename] = safe_open(os.path.join(self.path, filename), framework="pt", device="cpu")
            if not self.__dict__.get("file_of") and filename == WEIGHTS_NAME:
                self.file_of = {k: WEIGHTS_NAME for k in handles[filename].keys()}
        return handles[filename]

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def keys(self) -> list[str]:
        return list(self.file_of)

    def _slice(self, key: str) -> Any:
        return self._open_file(self.file_of[key]).get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only its part at ``index`` (one slice per dimension)."""
        tensor = self._slice(key)[index] if index is not None else self._slice(key)[:]
        self.elements_read += tensor.numel()
        return tensor


# --------------------------------------------------------------------------- loading into a live model


def _local_index(value: Any) -> tuple[slice, ...] | None:
    """The part of the whole tensor that this rank's shard of a ``DTensor`` holds, as slices; None where its
    layout is not plain ``Shard``/``Replicate`` placements (then the whole tensor is read and cut)."""
    tensor = lazy.dtensor()
    if any(type(p) not in (tensor.Shard, tensor.Replicate) for p in value.placements):
        return None
    local_shape_and_offset = tensor._utils.compute_local_shape_and_global_offset  # loaded with DTensor
    shape, offset = local_shape_and_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):
        return None
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


@torch.no_grad()
def _fill(value: torch.Tensor, directory: PretrainedDirectory, key: str) -> None:
    """Copy ``key`` from the directory into the live tensor ``value`` (this rank's part of it)."""
    tensor = lazy.dtensor()
    if not isinstance(value, tensor.DTensor):
        value.copy_(directory.read(key))
        return
    local = value.to_local()
    index = _local_index(value)
    if index is not None:
        local.copy_(directory.read(key, index))
        return
    mesh = value.device_mesh  # a strided layout (FSDP over tensor parallel): cut the whole tensor here
    whole = tensor.DTensor.from_local(directory.read(key).to(local.device, local.dtype), mesh,
                                      [tensor.Replicate()] * mesh.ndim, run_check=False)
    local.copy_(whole.redistribute(mesh, value.placements).to_local())  # a local slice: no traffic


@dataclass
class LoadReport:
    """What ``load_pretrained`` read: the model's path, how many tensors, and elements read on this rank."""

    path: str
    tensors: int
    elements_read: int


def _ignored(model: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or [])]


def load_pretrained(parts: Parts, model_path: str, ties: dict[str, str], directory_path: str,
                    ignore_missing: list[re.Pattern[str]] | None = None,
                    ignore_unexpected: list[re.Pattern[str]] | None = None) -> LoadReport:
    """Fill the model at ``model_path`` (in each part's names) from a Hugging Face directory. Every rank calls
    it: each reads its own parts' slices, then the ranks agree (one gather) on what was missing, unexpected
    or of another shape, and every rank raises the same error naming them."""
    prefix = f"{model_path}." if model_path else ""
    error, used, count, read = None, set(), 0, 0
    try:
        directory = PretrainedDirectory(directory_path)
        missing, mismatched, fills = [], [], []
        for part, _ in parts:
            live, _ = part_state(part, [])
            for key, value in live.items():
                if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
                    continue
                name = key[len(prefix):]
                source = name if name in directory else ties.get(name)
                if source is None or source not in directory:
                    if not any(p.search(name) for p in ignore_missing or []):
                        missing.append(name)
                    continue
                if directory.shape(source) != tuple(value.shape):
                    mismatched.append(f"{source} {list(directory.shape(source))} (the model's: "
                                      f"{list(value.shape)})")
                    continue
                fills.append((value, source))
        if missing or mismatched:
            said = []
            if missing:
                said.append(f"{len(missing)} of the model's tensors are not in it: {first_few(missing)}")
            if mismatched:
                said.append(f"{len(mismatched)} have another shape there: {first_few(mismatched)}")
            error = f"{directory_path} does not fit the model: {'; '.join(said)}"
        else:
            for value, source in fills:
                _fill(value, directory, source)
                used.add(source)
            count, read = len(fills), directory.elements_read
    except Exception as err:  # noqa: BLE001 - any rank's failure (safetensors' own errors too) is agreed on
        # below, so no rank raises alone while the others wait in the gather
        said = isinstance(err, (ConfigError, CheckpointError))
        error = str(err) if said else f"{type(err).__name__}: {err}"
    keys: list[str] = []
    if C.active():
        gathered = C.all_gather_object((error, sorted(used)))
        error = next((f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None), None)
        used = set().union(*(set(u) for _, u in gathered))
    if error is None:
        keys = PretrainedDirectory(directory_path).keys()
    unexpected = [k for k in keys if k not in used and not any(p.search(k) for p in ignore_unexpected or [])]
    if error is None and unexpected:
        error = (f"{directory_path} does not fit the model: {len(unexpected)} of its tensors are not the "
                 f"model's: {first_few(sorted(unexpected))}")
    if error is not None:
        raise ConfigError(f"trainer.init_weights: {error}. Give the directory of this model's architecture "
                          f"and size (its config.json should match the model's config)")
    return LoadReport(model_path, count, read)


def ignore_patterns(model: nn.Module) -> tuple[list[re.Pattern[str]], list[re.Pattern[str]]]:
    """The keys the model's class lets ``from_pretrained`` skip: missing ones, unexpected ones."""
    return (_ignored(model, "_keys_to_ignore_on_load_missing"),
            _ignored(model, "_keys_to_ignore_on_load_unexpected"))


# --------------------------------------------------------------------------- export


def _tensor_entries(source: str) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], torch.dtype]],
                                          Callable[[str], torch.Tensor]]:
    """The checkpoint's payload, each model entry's shape and dtype, and a reader of one entry. A sharded
    directory is read one tensor at a time; a file is read whole (it is one file on disk already)."""
    if not os.path.isdir(source):
        payload = read_checkpoint(source)
        model = payload.get("model") or {}
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.items() if isinstance(v, torch.Tensor)}
        return payload, shapes, lambda key: model[key]
    check_complete(source)
    payload = read_meta(source)
    metadata = safe_reader(source).read_metadata()
    tensor_meta = lazy.dcp().metadata.TensorStorageMetadata
    shapes = {k[len("model."):]: (tuple(m.size), m.properties.dtype)
              for k, m in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(m, tensor_meta)}

    def read_one(key: str) -> torch.Tensor:
        shape, dtype = shapes[key]
        state = {"model": {key: torch.empty(shape, dtype=dtype)}}
        with quiet_single_process():
            lazy.dcp().state_dict_loader._load_state_dict(state, storage_reader=safe_reader(source),
                                                          planner=safe_load_planner(empty=False),
                                                          no_dist=True)
        return state["model"][key]

    return payload, shapes, read_one


@dataclass
class ExportReport:
    """What ``export_pretrained`` wrote: the model's path in the checkpoint, its class, the tensors, files
    and bytes, and the tied names left out (stored under the names they are tied to)."""

    path: str
    architecture: str
    tensors: int
    files: list[str]
    total_bytes: int
    tied_left_out: list[str]


def _plan_files(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into output files of at most ``max_bytes`` each (a larger tensor gets a file alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name in names:
        if files[-1] and used + sizes[name] > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += sizes[name]
    return files


def export_pretrained(source: str, output: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      model: str | None = None) -> ExportReport:
    """Write ``source``'s Hugging Face model (a checkpoint file or sharded directory; the first the module
    held, or the one at path ``model``) to the new directory ``output``: ``config.json`` and safetensors
    under the model's own names, tied names left out as ``save_pretrained`` leaves them, several files with
    an index past ``max_shard_bytes``. The directory appears whole or not at all; an existing ``output``
    is never written into."""
    _, save_file = _safetensors()
    if os.path.exists(output):
        raise CheckpointError(f"{output} exists: export writes a new directory and never into one that "
                              f"holds files already; choose another path or remove it")
    payload, shapes, read_one = _tensor_entries(source)
    records = payload.get(RECORD_KEY)
    if not isinstance(records, dict) or not records:
        raise CheckpointError(f"{source} records no Hugging Face model: it was written by a module holding "
                              f"none, or by a polytrain before export existed. Export needs the model's "
                              f"config and place in the module, which a checkpoint of a module holding a "
                              f"transformers PreTrainedModel records")
    if model is not None and model not in records:
        raise CheckpointError(f"{source} records no Hugging Face model at {model!r}; it records "
                              f"{', '.join(repr(p) for p in records)}")
    record = records[model if model is not None else next(iter(records))]
    prefix = f"{record['path']}." if record["path"] else ""
    ties = dict(record.get("tied") or {})
    names = [k[len(prefix):] for k in shapes if k.startswith(prefix)]
    left_out = sorted(n for n in names if n in ties and ties[n] in names)
    names = [n for n in names if n not in left_out]
    if not names:
        raise CheckpointError(f"{source} holds no tensor under {record['path']!r}, where its record puts the "
                              f"{record['architecture']}")
    sizes = {n: math.prod(shapes[prefix + n][0]) * shapes[prefix + n][1].itemsize for n in names}
    groups = _plan_files(names, sizes, max_shard_bytes)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", dir=parent)
    try:
        filenames = ([WEIGHTS_NAME] if len(groups) == 1 else
                     [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
        for filename, group in zip(filenames, groups):
            tensors = {n: read_one(prefix + n).detach().cpu().contiguous() for n in group}
            save_file(tensors, os.path.join(staging, filename), metadata={"format": "pt"})
            del tensors
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {n: f for f, group in zip(filenames, groups) for n in group}}
            with open(os.path.join(staging, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        with open(os.path.join(staging, CONFIG_NAME), "w") as f:
            f.write(record["config"])
        os.rename(staging, output)  # the directory appears whole
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportReport(record["path"], record["architecture"], len(names), filenames, sum(sizes.values()),
                        left_out)
