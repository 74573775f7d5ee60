"""Hyperparameters as a YAML file, read and written as Lightning's ``core.saving`` does it, so a
project's ``save_hparams_to_yaml``/``load_hparams_from_yaml`` calls and the files they made keep working."""

from __future__ import annotations

import argparse
import copy
import os
import warnings
from enum import Enum
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import UnsupportedValueType, ValidationError

from polytrain.trainer.api.hparams import AttributeDict


def save_hparams_to_yaml(config_yaml: str | os.PathLike, hparams: dict[str, Any] | argparse.Namespace,
                         use_omegaconf: bool = True) -> None:
    """Write ``hparams`` (a dict, ``Namespace``, ``AttributeDict`` or ``DictConfig``) to ``config_yaml``.

    Through OmegaConf when it can hold every value (interpolations resolved, the user's object left
    as it was); otherwise as plain YAML, where an ``Enum`` is written by its name and a value YAML
    cannot hold is left out with a warning naming it."""
    folder = os.path.dirname(os.fspath(config_yaml)) or "."
    if not os.path.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}. Create it before writing {os.fspath(config_yaml)!r}.")
    if isinstance(hparams, argparse.Namespace):
        hparams = vars(hparams)
    elif isinstance(hparams, AttributeDict):
        hparams = dict(hparams)
    if use_omegaconf:
        plain = copy.deepcopy(hparams)
        if isinstance(plain, DictConfig):
            plain = OmegaConf.to_container(plain, resolve=True)
        else:
            plain = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
                     for k, v in plain.items()}
        try:
            text = OmegaConf.to_yaml(OmegaConf.create(plain))
        except (UnsupportedValueType, ValidationError, ValueError):
            pass
        else:
            with open(config_yaml, "w", encoding="utf-8") as out:
                out.write(text)
            return
    if not isinstance(hparams, dict):
        raise TypeError(f"hparams must be a dict, Namespace or AttributeDict, got {type(hparams).__name__}")
    kept: dict[str, Any] = {}
    for name, value in hparams.items():
        value = value.name if isinstance(value, Enum) else value
        try:
            yaml.dump(value)
        except (TypeError, ValueError, yaml.YAMLError):
            warnings.warn(f"Skipping '{name}' parameter because it is not possible to safely dump to YAML "
                          f"({type(value).__name__}).", stacklevel=2)
            continue
        kept[name] = value
    with open(config_yaml, "w", newline="", encoding="utf-8") as out:
        yaml.dump(kept, out)


def load_hparams_from_yaml(config_yaml: str | os.PathLike, use_omegaconf: bool = True) -> dict[str, Any]:
    """The hyperparameters in ``config_yaml`` (a ``DictConfig`` when ``use_omegaconf`` and OmegaConf
    can hold them); a missing file warns and gives ``{}``, as Lightning."""
    if not os.path.exists(config_yaml):
        warnings.warn(f"Missing Tags: {os.fspath(config_yaml)}.", RuntimeWarning, stacklevel=2)
        return {}
    with open(config_yaml, encoding="utf-8") as source:
        hparams = yaml.full_load(source)
    if use_omegaconf:
        try:
            return OmegaConf.create(hparams)  # type: ignore[return-value]
        except (UnsupportedValueType, ValidationError):
            pass
    return hparams
