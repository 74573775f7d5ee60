"""Hyperparameters (notes/lightning-spec.md §f): every form of ``save_hyperparameters()``, ``self.hparams``,
their place in checkpoints and in the loggers' files (CSV ``hparams.yaml``, TensorBoard's HParams), and
``MyModule.load_from_checkpoint(path, map_location=...)`` from single-process, ddp and fsdp checkpoints
(the last a sharded directory, read in one process), with the trained weights.

The expected hparams of each form are what Lightning 2.6.6 gives for the same classes."""

from __future__ import annotations

import argparse
import glob
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain import DataModule, LightningModule, Trainer
from polytrain.checkpoint.reading import read_checkpoint

pytestmark = pytest.mark.own_logic

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)


# --------------------------------------------------------------------------- save_hyperparameters' forms


class AllArgs(LightningModule):
    def __init__(self, lr: float = 0.1, depth: int = 2, net: nn.Module | None = None, *args: Any,
                 **kwargs: Any):
        super().__init__()
        self.save_hyperparameters(ignore=["net"])


class Chosen(LightningModule):
    def __init__(self, lr: float = 0.1, depth: int = 2, name: str = "x"):
        super().__init__()
        self.save_hyperparameters("lr", "name")


class FromObject(LightningModule):
    def __init__(self, conf: Any):
        super().__init__()
        self.save_hyperparameters(conf)


class WithModule(LightningModule):
    def __init__(self, lr: float = 0.1, net: nn.Module | None = None):
        super().__init__()
        self.save_hyperparameters()


class Sub(AllArgs):
    def __init__(self, extra: int = 5, **kwargs: Any):
        super().__init__(**kwargs)
        self.save_hyperparameters()


@pytest.mark.parametrize(("build", "expected"), [
    # *args dropped
    (lambda: AllArgs(0.2, 3, nn.Linear(1, 1), 7, extra_kw=1), {"lr": 0.2, "depth": 3, "extra_kw": 1}),
    (lambda: Chosen(0.3), {"lr": 0.3, "name": "x"}),
    (lambda: FromObject({"a": 1, "b": [1, 2]}), {"a": 1, "b": [1, 2]}),
    (lambda: FromObject(argparse.Namespace(a=1, b="z")), {"a": 1, "b": "z"}),
    # a subclass after its base: the union
    (lambda: Sub(extra=6, lr=0.5), {"lr": 0.5, "depth": 2, "extra": 6}),
])
def test_save_hyperparameters_forms(build: Any, expected: dict) -> None:
    assert dict(build().hparams) == expected


def test_a_subclass_ignore_overrides_its_bases() -> None:
    class Base(LightningModule):
        def __init__(self, a: int, b: int, c: int):
            super().__init__()
            self.save_hyperparameters(ignore="a")

    class Child(Base):
        def __init__(self, a: int, b: int, c: int):
            super().__init__(a=a, b=b, c=c)
            self.save_hyperparameters(ignore=["b"])

    assert dict(Child(a=1, b=2, c=3).hparams) == {"a": 1, "c": 3}  # b: saved by Base, dropped by Child


def test_a_module_built_inside_another_modules_init_takes_its_arguments_too() -> None:
    """Lightning's composition rule: the frames of hyperparameter-keeping objects' ``__init__`` chain up to
    the first plain object, whose own arguments stay out."""
    class Child(DataModule):
        def __init__(self, dropout: float, init: str):
            super().__init__()
            self.save_hyperparameters(ignore=["dropout"])

    class Parent(LightningModule):
        def __init__(self, batch_size: int):
            super().__init__()
            self.child = Child(dropout=0.1, init="xavier")

    class Plain:
        def __init__(self, run_id: str = "abc"):
            self.parent = Parent(batch_size=64)

    assert dict(Plain().parent.child.hparams) == {"init": "xavier", "batch_size": 64}


def test_a_dataclass_module_saves_its_init_fields() -> None:
    import dataclasses

    @dataclasses.dataclass(eq=False)
    class Fields(LightningModule):
        mandatory: int
        optional: str = "x"
        derived: int = dataclasses.field(init=False, default=0)

        def __post_init__(self) -> None:
            super().__init__()
            self.save_hyperparameters()

    assert dict(Fields(33, optional="y").hparams) == {"mandatory": 33, "optional": "y"}


def test_hparams_attribute_access_and_initial_copy() -> None:
    module = AllArgs(0.2)
    assert module.hparams.lr == module.hparams["lr"] == 0.2
    module.hparams.lr = 9.0
    assert module.hparams["lr"] == 9.0 and module.hparams_initial.lr == 0.2  # the copy at save time
    with pytest.raises(AttributeError, match="no hyperparameter 'width'; saved: lr, depth"):
        module.hparams.width  # noqa: B018


def test_an_nn_module_argument_warns_to_ignore_it() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = WithModule(0.4, nn.Linear(1, 1))
    assert any("pass ignore=['net']" in str(w.message) for w in caught)
    assert set(module.hparams) == {"lr", "net"}  # kept (as Lightning); stored by repr in checkpoints


# --------------------------------------------------------------------------- checkpoints and loggers


def regressor_class(base: type) -> type:
    """The same module over polytrain's LightningModule or over Lightning's (for a Lightning checkpoint)."""

    class Regressor(base):  # type: ignore[valid-type, misc]
        def __init__(self, hidden: int = 8, lr: float = 0.05, optim: dict | None = None):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
            self.loaded_keys: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)),
                              batch_size=4)

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.loaded_keys = sorted(checkpoint)

    return Regressor


Regressor = regressor_class(LightningModule)


class Data(DataModule):
    def __init__(self, batch_size: int = 4, augment: bool = False):
        super().__init__()
        self.save_hyperparameters()


def _tensorboard_hparams(log_dir: str) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    found: dict[str, Any] = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "hparams":
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    for key, v in data.session_start_info.hparams.items():
                        found[key] = getattr(v, v.WhichOneof("kind"))
    return found


def test_hparams_in_the_checkpoint_and_in_the_loggers_files(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    module = Regressor(hidden=8, lr=0.05, optim={"momentum": 0.9, "nesterov": True})
    Trainer(**QUIET, devices=1, default_root_dir=root, max_epochs=1).fit(module,
                                                                         datamodule=Data(batch_size=4))
    checkpoint = read_checkpoint(os.path.join(root, "version_0", "checkpoints", "last.ckpt"))
    assert checkpoint["hyper_parameters"] == {"hidden": 8, "lr": 0.05,
                                              "optim": {"momentum": 0.9, "nesterov": True}}
    assert checkpoint["datamodule_hyper_parameters"] == {"batch_size": 4, "augment": False}
    expected = {"batch_size": 4, "augment": False, "hidden": 8, "lr": 0.05,
                "optim": {"momentum": 0.9, "nesterov": True}}
    # Both default loggers write hparams.yaml into the run's directory (as Lightning's, in theirs).
    with open(os.path.join(root, "version_0", "hparams.yaml"), encoding="utf-8") as fh:
        assert yaml.safe_load(fh) == expected
    # The HParams tab, flattened (torch's hparams summary stores booleans as numbers, as under Lightning).
    assert _tensorboard_hparams(os.path.join(root, "version_0")) == pytest.approx(
        {"batch_size": 4.0, "augment": 0.0, "hidden": 8.0, "lr": 0.05, "optim/momentum": 0.9,
         "optim/nesterov": 1.0})


def test_save_hyperparameters_logger_false_keeps_them_out_of_the_loggers(tmp_path: Any) -> None:
    class Quiet(Regressor):
        def __init__(self, hidden: int = 8):
            super().__init__(hidden=hidden)
            self.save_hyperparameters(logger=False)

    root = str(tmp_path / "run")
    Trainer(**QUIET, devices=1, default_root_dir=root, max_epochs=1, logger="csv").fit(Quiet())
    assert not os.path.exists(os.path.join(root, "version_0", "hparams.yaml"))
    assert read_checkpoint(os.path.join(root, "version_0", "checkpoints",
                                        "last.ckpt"))["hyper_parameters"]["hidden"] == 8


# --------------------------------------------------------------------------- load_from_checkpoint


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def _check_loaded(path: str, trained: dict[str, torch.Tensor]) -> None:
    loaded = Regressor.load_from_checkpoint(path, map_location="cpu")
    assert (loaded.hparams.hidden, loaded.hparams.lr) == (16, 0.05)
    assert _same_weights(loaded.state_dict(), trained)
    assert loaded.training  # as Lightning: returned in train mode
    assert "state_dict" in loaded.loaded_keys and "hyper_parameters" in loaded.loaded_keys  # the hook's view
    # Keyword arguments win over the saved hyperparameters (here: the learning rate, not the shapes).
    assert Regressor.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5
    moved = Regressor.load_from_checkpoint(path, map_location=torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in moved.parameters())
    mapped = Regressor.load_from_checkpoint(path, map_location={"cuda:0": "cpu"})  # torch.load's dict form
    assert _same_weights(mapped.state_dict(), trained)


def test_load_from_checkpoint_of_a_single_process_run(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    module = Regressor(hidden=16)
    Trainer(**QUIET, devices=1, default_root_dir=root, max_epochs=2, logger=False).fit(module)
    _check_loaded(os.path.join(root, "version_0", "checkpoints", "last.ckpt"), module.state_dict())
    # a keyword __init__ does not take is dropped, as Lightning drops it, with a warning naming the valid ones
    with pytest.warns(UserWarning, match=r"\['unknown'\] ignored: not arguments of Regressor.__init__ "
                                         r"\(hidden"):
        Regressor.load_from_checkpoint(os.path.join(root, "version_0", "checkpoints", "last.ckpt"), unknown=1)


def _distributed_fit(rank: int, world_size: int, root: str, strategy: str) -> dict[str, Any]:
    module = Regressor(hidden=16)
    trainer = Trainer(**QUIET, strategy=strategy, devices=world_size, default_root_dir=root, max_epochs=2,
                      logger=False)
    trainer.fit(module)
    state = trainer.strategy.module_state_dict()  # every rank: a collective under fsdp
    return {"path": trainer.checkpoint_callback.last_model_path,
            "state": {k: v.detach().clone() for k, v in state.items()} if rank == 0 else None}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_load_from_checkpoint_of_a_two_rank_run(tmp_path: Any, strategy: str) -> None:
    results = run_distributed(_distributed_fit, 2, str(tmp_path / strategy), strategy, timeout=180.0)
    path = results[0]["path"]
    # fsdp: a sharded DCP directory
    assert os.path.isdir(path) if strategy == "fsdp" else path.endswith(".ckpt")
    _check_loaded(path, results[0]["state"])


def test_load_from_checkpoint_of_a_lightning_checkpoint(tmp_path: Any) -> None:
    """A checkpoint Lightning wrote gives its weights and hyperparameters to the renamed module."""
    pl = pytest.importorskip("lightning.pytorch")
    module = regressor_class(pl.LightningModule)(hidden=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module)
    path = str(tmp_path / "lightning.ckpt")
    trainer.save_checkpoint(path)
    loaded = Regressor.load_from_checkpoint(path)
    assert loaded.hparams.hidden == 16 and _same_weights(loaded.state_dict(), module.state_dict())


def test_a_name_the_module_and_the_datamodule_both_save_with_different_values_is_refused(
        tmp_path: Any) -> None:
    class Batched(Regressor):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(RuntimeError, match=r"Error while merging hparams: the keys \['batch_size'\] .* "
                                           r"\(batch_size: 8 vs 4\)"):
        Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1).fit(
            Batched(), datamodule=Data(batch_size=4))
    # the same value in both, or no logger to record them: nothing to choose between
    Trainer(**QUIET, devices=1, default_root_dir=str(tmp_path), max_epochs=1).fit(
        Batched(batch_size=4), datamodule=Data(batch_size=4))
    Trainer(**{**QUIET, "logger": False}, devices=1, default_root_dir=str(tmp_path), max_epochs=1).fit(
        Batched(), datamodule=Data(batch_size=4))


def test_older_lightning_files_hyperparameter_keys_are_read(tmp_path: Any) -> None:
    from polytrain.loggers import TensorBoardLogger

    assert TensorBoardLogger.NAME_HPARAMS_FILE == "hparams.yaml"
    module = Regressor(hidden=12)
    path = str(tmp_path / "old.ckpt")
    torch.save({"pytorch-lightning_version": "0.9.0", "state_dict": module.state_dict(),
                "module_arguments": {"hidden": 12, "lr": 0.2}}, path)
    assert Regressor.load_from_checkpoint(path).hparams.lr == 0.2


def test_values_passed_where_argument_names_belong_are_named() -> None:
    class Valued(LightningModule):
        def __init__(self, arg1: float = 3.14, arg2: str = "abc"):
            super().__init__()
            self.save_hyperparameters(arg1, arg2)

    with pytest.raises(ValueError, match=r"Primitives \(<class 'bool'>.* \[3.14\] look like values\. "
                                         r"Pass the names of Valued.__init__'s arguments \(arg1, arg2\)"):
        Valued()


def test_the_container_a_checkpoint_records_is_not_a_method_of_the_users_module(tmp_path: Any) -> None:
    """A hook recorder (Lightning's tests wrap every method of a module) sees only Lightning's names."""
    from polytrain.trainer.api.hparams import hparams_container

    module = FromObject({"lr": 0.1})
    assert not hasattr(module, "hparams_container")
    assert hparams_container(module) == {"hparams_name": "conf", "hparams_type": "dict"}
