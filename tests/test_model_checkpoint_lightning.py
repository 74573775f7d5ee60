"""ModelCheckpoint as Lightning's: file names (``{epoch}-{step}`` by default, ``name=`` inserted, names with
``/``, a field nothing logged written as 0); a ``dirpath`` holding only the files asked for (``save_last``
off by default, no pointer file, ``ckpt_path="last"`` looking there); a fit that ran its epochs out saving
only on its triggers; and ``save_weights_only``: the model without the optimizer's state, a file that
starts an evaluation or a new fit and refuses to resume one, on one process and under fsdp x2."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import TinyModule
from distributed import run_distributed

from polytrain import Trainer
from polytrain.callbacks import ModelCheckpoint
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic


def test_default_and_templated_names_are_lightnings() -> None:
    checkpoint = ModelCheckpoint(dirpath="/ckpts")
    assert checkpoint.format_checkpoint_name({"epoch": 3, "step": 2}) == "/ckpts/epoch=3-step=2.ckpt"
    named = ModelCheckpoint(filename="{epoch:02d}-{val/loss:.2f}")
    assert named.format_checkpoint_name({"epoch": 3, "val/loss": 0.1234}) == "epoch=03-val_loss=0.12.ckpt"
    plain = ModelCheckpoint(filename="{epoch}-{acc:.3f}", auto_insert_metric_name=False)
    path = plain.format_checkpoint_name({"epoch": 1, "acc": 0.5}, ver=2, prefix="run")
    assert path == "run-1-0.500-v2.ckpt"


def test_a_field_nothing_logged_is_written_as_zero_with_a_warning() -> None:
    checkpoint = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}")
    with pytest.warns(UserWarning, match=r"names 'val_loss', which nothing logged; it is written as 0"):
        assert checkpoint.format_name({"epoch": 0, "step": 1}) == "epoch=0-val_loss=0.00"


def test_a_fit_writes_lightnings_names(make_trainer: Any, tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="val/loss", filename="{epoch}-{val/loss:.3f}",
                                 save_last=False)
    trainer = make_trainer(max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(TinyModule(n=8, val_n=4))
    score = float(trainer.callback_metrics["val/loss"])
    assert os.path.basename(checkpoint.best_model_path) == f"epoch=0-val_loss={score:.3f}.ckpt"


def test_a_dirpath_you_name_holds_only_the_files_asked_for(make_trainer: Any, tmp_path: Any) -> None:
    """Lightning's defaults: no ``last.ckpt`` unless ``save_last``, and no pointer file beside them; ``resume:
    last`` still finds the newest by the step recorded inside."""
    def saver(**kwargs: Any) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}", save_top_k=-1, **kwargs)

    make_trainer(max_epochs=2, callbacks=[saver()], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    resumed = make_trainer(max_epochs=3, callbacks=[saver(save_last="link")], enable_checkpointing=True)
    resumed.fit(TinyModule(n=8, val_n=4), ckpt_path="last")
    assert resumed.global_step == 6  # 2 epochs restored, 1 trained
    expected = ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == expected
    with pytest.raises(ConfigError, match="save_last='always'"):
        ModelCheckpoint(save_last="always")


def test_a_fit_that_runs_its_epochs_out_saves_on_its_triggers_only(make_trainer: Any, tmp_path: Any) -> None:
    every_other = ModelCheckpoint(dirpath=str(tmp_path / "epochs"), filename="{epoch}", every_n_epochs=2,
                                  save_top_k=-1)
    trainer = make_trainer(max_epochs=5, callbacks=[every_other], enable_checkpointing=True)
    trainer.fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "epochs")) == ["epoch=1.ckpt", "epoch=3.ckpt"]
    # stopped inside an epoch (max_steps): the state there is saved, so `resume: last` continues from it
    stepped = ModelCheckpoint(dirpath=str(tmp_path / "steps"), every_n_epochs=None, every_n_train_steps=2,
                              save_top_k=-1)
    make_trainer(max_steps=3, callbacks=[stepped], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "steps")) == ["epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt"]


def test_the_signature_holds_types_a_command_line_parser_reads() -> None:
    """jsonargparse (LightningCLI's parser) builds ``--save_last`` from the annotation itself: it must be
    Lightning's type, not the string a postponed annotation leaves."""
    import inspect
    import typing

    parameters = inspect.signature(ModelCheckpoint).parameters
    annotation = parameters["save_last"].annotation
    assert not isinstance(annotation, str)
    assert set(typing.get_args(annotation)) == {bool, typing.Literal["link"], type(None)}
    assert not any(isinstance(p.annotation, str) for p in parameters.values())


def test_the_trainers_own_checkpoint_callback_keeps_last_for_resume(make_trainer: Any, run_dir: str) -> None:
    trainer = make_trainer(max_epochs=1, enable_checkpointing=True)
    trainer.fit(TinyModule(n=8, val_n=None))
    assert trainer.checkpoint_callback.save_last is True
    assert "last.ckpt" in os.listdir(os.path.dirname(trainer.checkpoint_callback.best_model_path))


def test_a_name_taken_gets_a_version_and_no_kept_file_is_written_over(make_trainer: Any,
                                                                      tmp_path: Any) -> None:
    """``save_top_k=-1`` with one fixed name keeps every save (``-v1``, ``-v2``, ... from
    ``STARTING_VERSION``); a top-1 callback with one name replaces its own file (no alternating names);
    ``save_last`` writes ``last.ckpt`` in place when the newest save is not kept;
    ``enable_version_counter=False`` writes over."""
    class FromFive(ModelCheckpoint):
        STARTING_VERSION = 5

    keep_all = FromFive(dirpath=str(tmp_path / "all"), filename="fixed", save_top_k=-1)
    make_trainer(max_epochs=3, callbacks=[keep_all], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "all")) == ["fixed-v5.ckpt", "fixed-v6.ckpt", "fixed.ckpt"]
    assert len({os.path.getmtime(tmp_path / "all" / name) for name in os.listdir(tmp_path / "all")}) == 3

    one = ModelCheckpoint(dirpath=str(tmp_path / "one"), filename="model", save_top_k=1)
    make_trainer(max_epochs=3, callbacks=[one], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert os.listdir(tmp_path / "one") == ["model.ckpt"]

    class Worsening(TinyModule):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("score", float(self.current_epoch))

    best_and_last = ModelCheckpoint(dirpath=str(tmp_path / "last"), monitor="score", save_top_k=1,
                                    save_last=True, filename="best-{epoch}")
    trainer = make_trainer(max_epochs=3, callbacks=[best_and_last], enable_checkpointing=True)
    trainer.fit(Worsening(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "last")) == ["best-epoch=0.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last" / "last.ckpt", weights_only=False)["loop"]["epoch"] == 3

    for _ in range(2):
        fixed = ModelCheckpoint(dirpath=str(tmp_path / "over"), filename="{epoch}", save_top_k=-1,
                                save_last=True, enable_version_counter=False)
        make_trainer(max_epochs=2, callbacks=[fixed], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path / "over")) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]


def test_a_subclass_names_its_own_extension(make_trainer: Any, tmp_path: Any) -> None:
    class Backwards(ModelCheckpoint):
        FILE_EXTENSION = ".tpkc"

    saver = Backwards(dirpath=str(tmp_path), save_last=True)
    make_trainer(max_steps=1, callbacks=[saver], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=1.tpkc", "last.tpkc"]


def _optimizer_moments(path: str) -> bool:
    return "optimizer" in torch.load(path, weights_only=False)


def test_weights_only_checkpoints_hold_the_model_and_refuse_to_resume(make_trainer: Any,
                                                                      tmp_path: Any) -> None:
    light = ModelCheckpoint(dirpath=str(tmp_path / "light"), save_weights_only=True, save_last=False)
    full = ModelCheckpoint(dirpath=str(tmp_path / "full"), every_n_epochs=1, save_last=False)
    module = TinyModule(n=8, val_n=4)
    trainer = make_trainer(max_epochs=1, callbacks=[light, full], enable_checkpointing=True)
    trainer.fit(module)
    saved = torch.load(light.best_model_path, weights_only=False)
    assert saved["weights_only"] is True and "optimizer" not in saved and "callbacks" not in saved
    assert _optimizer_moments(full.best_model_path)
    assert torch.equal(saved["model"]["net.weight"], module.net.weight.detach())
    assert saved["loop"]["global_step"] == trainer.global_step
    # it starts an evaluation (and load_from_checkpoint) with the trained weights
    loaded = TinyModule.load_from_checkpoint(light.best_model_path)
    assert torch.equal(loaded.net.weight, module.net.weight.detach())
    results = make_trainer().validate(TinyModule(n=8, val_n=4), ckpt_path=light.best_model_path,
                                      verbose=False)
    assert results[0]["val/loss"] == pytest.approx(float(trainer.callback_metrics["val/loss"]))
    # and is refused as a resume, in words naming the file and what to do
    with pytest.raises(ConfigError, match=r"holds the model's weights only .*load_from_checkpoint"):
        make_trainer(max_epochs=2).fit(TinyModule(n=8, val_n=4), ckpt_path=light.best_model_path)


def _fsdp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    light = ModelCheckpoint(dirpath=os.path.join(root, "light"), save_weights_only=True, save_last=False)
    common = dict(strategy="fsdp", accelerator="cpu", devices=2, run_dir=root, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, timeout=60)
    module = TinyModule(n=16, val_n=8)
    trainer = Trainer(**common, max_epochs=1, callbacks=[light])
    trainer.fit(module)
    fitted = float(trainer.callback_metrics["val/loss"])
    results = Trainer(**common, enable_checkpointing=False).validate(
        TinyModule(n=16, val_n=8), ckpt_path=light.best_model_path, verbose=False)
    try:
        Trainer(**common, max_epochs=2, enable_checkpointing=False).fit(
            TinyModule(n=16, val_n=8), ckpt_path=light.best_model_path)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return {"path": light.best_model_path, "fitted": fitted, "validated": results[0]["val/loss"],
            "refused": refused}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_weights_only_under_fsdp_writes_a_sharded_model_that_evaluates_and_refuses_a_resume(
        tmp_path: Any) -> None:
    ranks = run_distributed(_fsdp_worker, 2, str(tmp_path), timeout=240.0)
    path = ranks[0]["path"]
    assert os.path.isdir(path), "fsdp writes a sharded directory"
    for rank in ranks:
        assert rank["validated"] == pytest.approx(rank["fitted"], rel=1e-6)
        assert "holds the model's weights only" in rank["refused"]
    from torch.distributed.checkpoint import FileSystemReader

    stored = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert any(key.startswith("model") for key in stored), stored
    assert not any("optim" in key for key in stored), stored


def test_a_files_epoch_is_the_one_it_was_saved_in_and_a_finished_run_is_not_resumed_into_fewer_epochs(
        make_trainer: Any, tmp_path: Any) -> None:
    saver = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch}", save_top_k=-1)
    make_trainer(max_epochs=3, callbacks=[saver], enable_checkpointing=True).fit(TinyModule(n=8, val_n=4))
    saved = {name: torch.load(tmp_path / name, weights_only=False) for name in sorted(os.listdir(tmp_path))}
    # Lightning's `epoch`: trainer.current_epoch at the save; the loop's says where a resume continues
    assert [(ckpt["epoch"], ckpt["loop"]["epoch"]) for ckpt in saved.values()] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError, match=r"restored a checkpoint with current_epoch=3, but you have set "
                                          r"Trainer\(max_epochs=1\)"):
        make_trainer(max_epochs=1).fit(TinyModule(n=8, val_n=4), ckpt_path=str(tmp_path / "epoch=2.ckpt"))
    resumed = make_trainer(max_epochs=3)  # as many epochs as it ran: nothing left to train, no error
    resumed.fit(TinyModule(n=8, val_n=4), ckpt_path=str(tmp_path / "epoch=2.ckpt"))
    assert resumed.global_step == 6


class _FallingLoss(TinyModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", 1.0 / (self.current_epoch + 2))  # 0.5, 0.333.., 0.25


def test_scores_are_tensors_as_lightnings_and_older_float_files_load(make_trainer: Any,
                                                                     tmp_path: Any) -> None:
    # Lightning code reads checkpoint_callback.best_model_score.item(); older files hold floats.
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="score", mode="min", save_top_k=2)
    make_trainer(max_epochs=3, callbacks=[mc]).fit(_FallingLoss())
    assert isinstance(mc.best_model_score, torch.Tensor) and mc.best_model_score.item() == pytest.approx(0.25)
    assert isinstance(mc.current_score, torch.Tensor) and mc.current_score.item() == pytest.approx(0.25)
    saved = torch.load(mc.best_model_path, weights_only=True)["callbacks"][mc.state_key]
    assert float(saved["best_model_score"]) == pytest.approx(0.25)
    restored = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="score", mode="min", save_top_k=2)
    restored.load_state_dict({**saved, "best_model_score": 0.25, "current_score": 0.5})
    assert restored.best_model_score.item() == 0.25 and restored.current_score.item() == 0.5


@pytest.mark.parametrize("every_n_epochs", [0, 5])
def test_save_last_writes_last_at_the_end_of_a_fit_no_trigger_saved_in(make_trainer: Any, tmp_path: Any,
                                                                       every_n_epochs: int) -> None:
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_epochs=every_n_epochs, save_last=True,
                         save_top_k=0)
    trainer = make_trainer(max_epochs=2, callbacks=[mc])
    trainer.fit(TinyModule())
    assert sorted(os.listdir(tmp_path / "ck")) == ["last.ckpt"]
    assert mc.last_model_path == str(tmp_path / "ck" / "last.ckpt") and mc.best_model_path == ""
    assert torch.load(mc.last_model_path, weights_only=True)["global_step"] == trainer.global_step
    # a fit whose trigger saved keeps what it wrote: no second save of that step
    saving = ModelCheckpoint(dirpath=str(tmp_path / "ck2"), every_n_epochs=1, save_last=True)
    make_trainer(max_epochs=2, callbacks=[saving]).fit(TinyModule())
    assert sorted(os.listdir(tmp_path / "ck2")) == ["epoch=1-step=8.ckpt", "last.ckpt"]
