"""``DataModule``: the data side of a job in one class, as Lightning's ``LightningDataModule``.

The Trainer calls ``prepare_data`` (downloads: once per node, or once in all with
``prepare_data_per_node = False``, while the other ranks wait at a barrier), then ``setup(stage)``
on every rank, then the ``*_dataloader`` methods; ``teardown(stage)`` at the end. Its ``state_dict``
is saved in checkpoints under its class name and given back to ``load_state_dict`` on resume.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sized
from typing import Any

from torch.utils.data import DataLoader, Dataset

from polytrain.trainer.api.data_hooks import DataHooks
from polytrain.trainer.api.hparams import HyperparametersMixin, load_datamodule_from_checkpoint


class DataModule(HyperparametersMixin, DataHooks):
    name: str | None = None
    # where a checkpoint keeps a DataModule's hyperparameters (beside the module's own), Lightning's keys
    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "datamodule_hparams_type"

    def __init__(self) -> None:
        self.trainer: Any = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def on_exception(self, exception: BaseException) -> None: ...

    def __str__(self) -> str:
        """Each stage's loader and its dataset's size, in Lightning's layout (``{Train dataloader: size=64}``
        a line per stage; ``None`` where the method is missing, fails or gives nothing; several loaders
        numbered). The loader methods are called to find out, as Lightning does."""
        lines = []
        stages = (("Train dataloader", "train_dataloader"), ("Validation dataloader", "val_dataloader"),
                  ("Test dataloader", "test_dataloader"), ("Predict dataloader", "predict_dataloader"))
        for title, method in stages:
            try:
                loaders = getattr(self, method)()
            except Exception:  # noqa: BLE001 - a stage not set up (or not written) shows as None
                loaders = None
            if isinstance(loaders, DataLoader):
                shown = _dataset_size(loaders)
            elif isinstance(loaders, (list, tuple, dict)):
                items = loaders.values() if isinstance(loaders, dict) else loaders
                shown = " ; ".join(
                    f"{i}. {_dataset_size(loader)}" if isinstance(loader, DataLoader) else "None"
                    for i, loader in enumerate(items, start=1))
            else:
                shown = "None"
            lines.append(f"{{{title}: {shown}}}")
        return os.linesep.join(lines)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, map_location: Any = None,
                             hparams_file: str | None = None, weights_only: bool | None = None,
                             **kwargs: Any) -> DataModule:
        """A new DataModule built from the checkpoint's saved hyperparameters (``**kwargs`` win), with its
        state. ``map_location`` is accepted for Lightning code and moves nothing (a DataModule holds no
        weights)."""
        if hparams_file is not None:
            raise ValueError("hparams_file is not supported: polytrain checkpoints carry their "
                             "hyperparameters")
        return load_datamodule_from_checkpoint(cls, checkpoint_path, weights_only, **kwargs)

    @classmethod
    def from_datasets(cls, train_dataset: Dataset | None = None, val_dataset: Dataset | None = None,
                      test_dataset: Dataset | None = None, predict_dataset: Dataset | None = None,
                      batch_size: int = 1, num_workers: int = 0, **datamodule_kwargs: Any) -> DataModule:
        """A DataModule of this class serving the given datasets (training shuffled), as Lightning's:
        ``datamodule_kwargs`` go to its ``__init__``, and ``batch_size`` and ``num_workers`` too where it
        takes them (they also build the loaders)."""
        datasets = {"train": train_dataset, "val": val_dataset, "test": test_dataset,
                    "predict": predict_dataset}

        def loader(stage: str) -> Callable[[DataModule], Any]:
            def make(self: DataModule) -> Any:
                dataset = datasets[stage]
                return None if dataset is None else DataLoader(
                    dataset, batch_size=batch_size, shuffle=stage == "train", num_workers=num_workers)

            make.__name__ = f"{stage}_dataloader"
            return make

        # A subclass of its own (not methods set on an instance): the loader methods are the class's.
        served = type(cls.__name__, (cls,), {f"{stage}_dataloader": loader(stage) for stage in datasets})
        parameters = inspect.signature(cls.__init__).parameters
        special = {"batch_size": batch_size, "num_workers": num_workers}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            special = {k: v for k, v in special.items() if k in parameters}
        return served(**datamodule_kwargs, **special)


def _dataset_size(loader: DataLoader) -> str:
    dataset = loader.dataset
    return f"size={len(dataset)}" if isinstance(dataset, Sized) else "size=NA"


LightningDataModule = DataModule  # Lightning's name for it
