"""Loaders as Lightning projects hand them over: a wrapper whose ``__len__`` raises NotImplementedError, an
``IterableDataset`` with ``limit_*_batches=1.0``, Lightning's ``utilities.data`` questions, a
``CombinedLoader`` over nested collections, and each evaluation loader's index reaching the batch-transfer
hooks."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from conftest import TinyModule, make_dataset
from torch.utils.data import DataLoader, IterableDataset

from polytrain.utilities import CombinedLoader
from polytrain.utilities.data import has_iterable_dataset, has_len, has_len_all_ranks

pytestmark = pytest.mark.own_logic


class NoLengthWrapper:
    """A loader wrapper that cannot know its length, as some streaming wrappers answer ``len()``."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset

    def __iter__(self) -> Any:
        return iter(self.loader)

    def __len__(self) -> int:
        raise NotImplementedError


class Stream(IterableDataset):
    def __init__(self, n: int, with_len: bool = False) -> None:
        self.samples = make_dataset(n, 4, seed=0)
        self.with_len = with_len

    def __iter__(self) -> Any:
        return iter(self.samples)

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("no length")
        return len(self.samples)


def test_a_wrapper_whose_len_raises_not_implemented_trains_as_a_stream(make_trainer: Any) -> None:
    class Wrapped(TinyModule):
        def train_dataloader(self) -> Any:
            return NoLengthWrapper(super().train_dataloader())

    trainer = make_trainer(max_epochs=2)
    trainer.fit(Wrapped(n=16, batch_size=4, val_n=None))
    assert trainer.global_step == 8  # 4 batches an epoch, counted by running out, twice
    assert trainer.num_training_batches == math.inf  # Lightning's count for a loader without length


def test_a_stream_with_limit_one_point_zero_runs_whole(make_trainer: Any) -> None:
    class Streaming(TinyModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Stream(16), batch_size=4)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(Stream(8), batch_size=4)

    trainer = make_trainer(max_epochs=1, limit_train_batches=1.0, limit_val_batches=1.0)
    trainer.fit(Streaming())
    assert trainer.global_step == 4
    assert trainer.num_training_batches == math.inf and trainer.num_val_batches == [math.inf]


def test_a_fraction_below_one_of_a_stream_is_refused(make_trainer: Any) -> None:
    class Streaming(TinyModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Stream(16), batch_size=4)

    with pytest.raises(ValueError, match=r"IterableDataset`.*limit_train_batches\)`.*`1.0` or an int"):
        make_trainer(max_epochs=1, limit_train_batches=0.5).fit(Streaming(val_n=None))


def test_utilities_data_answers_lightnings_questions() -> None:
    sized = DataLoader(make_dataset(8, 4, seed=0), batch_size=4)
    assert has_len(sized) and not has_iterable_dataset(sized)
    assert has_len_all_ranks(sized, None)  # no strategy yet: this process's length alone
    assert not has_len(NoLengthWrapper(sized)) and not has_len_all_ranks(NoLengthWrapper(sized), None)
    unsized_stream = DataLoader(Stream(8), batch_size=4)
    assert has_iterable_dataset(unsized_stream) and not has_len_all_ranks(unsized_stream, None)
    with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined"):
        assert has_len_all_ranks(DataLoader(Stream(8, with_len=True), batch_size=4), None)
    with pytest.warns(UserWarning, match="length 0 on every rank"):
        assert has_len_all_ranks(DataLoader([], batch_size=4), None)


def test_an_iterable_dataset_with_len_is_warned_about_in_every_stage(make_trainer: Any) -> None:
    loader = DataLoader(Stream(8, with_len=True), batch_size=4)
    module = TinyModule(val_n=None)
    trainer = make_trainer(max_epochs=1)
    for run in (lambda: trainer.validate(module, dataloaders=loader),
                lambda: trainer.fit(module, train_dataloaders=loader),
                lambda: trainer.test(module, dataloaders=loader),
                lambda: trainer.predict(module, dataloaders=loader)):
        with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined"):
            run()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer.validate(module, dataloaders=DataLoader(make_dataset(8, 4, seed=1), batch_size=4))


def test_a_combined_loader_over_nested_collections_keeps_their_shape(make_trainer: Any) -> None:
    long, short = DataLoader(make_dataset(16, 4, seed=0)), DataLoader(make_dataset(4, 4, seed=1))
    combined = CombinedLoader({"a_b": [long, short], "c": short}, "max_size_cycle")
    assert len(combined) == 16 and combined.flattened == [long, short, short]
    batch, batch_idx, dataloader_idx = next(iter(combined))
    assert set(batch) == {"a_b", "c"} and len(batch["a_b"]) == 2 and (batch_idx, dataloader_idx) == (0, 0)
    assert torch.equal(batch["a_b"][0][0], long.dataset[0][0].unsqueeze(0))

    seen: list[tuple[int, int]] = []

    class Nested(TinyModule):
        def train_dataloader(self) -> Any:
            return CombinedLoader({"a_b": [DataLoader(self.train_ds, batch_size=4), long], "c": short},
                                  "min_size")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append((len(batch["a_b"]), len(batch["a_b"][0][0])))
            return super().training_step(batch["a_b"][0], batch_idx)

    trainer = make_trainer(max_epochs=1)
    trainer.fit(Nested(n=16, val_n=None))
    assert trainer.num_training_batches == 4 and seen == [(2, 4)] * 4  # min_size: the 4-sample loader


def test_each_evaluation_loader_index_reaches_the_transfer_hooks(make_trainer: Any) -> None:
    calls: list[tuple[str, int]] = []

    class Indexed(TinyModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("before", dataloader_idx))
            return batch

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("after", dataloader_idx))
            return batch

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return super().validation_step(batch, batch_idx)

        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(self.val_ds, batch_size=4), DataLoader(self.val_ds, batch_size=8)]

    trainer = make_trainer(max_epochs=1, limit_train_batches=0)
    trainer.validate(Indexed(val_n=8))
    assert calls == [("before", 0), ("after", 0), ("before", 0), ("after", 0), ("before", 1), ("after", 1)]


def test_a_step_that_expects_the_other_loader_count_is_told_so(make_trainer: Any) -> None:
    class NeedsIndex(TinyModule):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> Any:
            return super().validation_step(batch, batch_idx)

    class NoIndex(TinyModule):
        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(self.val_ds, batch_size=4)] * 2

    class HookNeedsIndex(TinyModule):
        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int) -> None:
            pass

    class Ignores(NoIndex):
        def validation_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
            return super().validation_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match=r"single `val_dataloader`.*`NeedsIndex.validation_step\(\)`"):
        trainer.validate(NeedsIndex())
    with pytest.raises(RuntimeError, match=r"multiple `val_dataloader`s.*no `dataloader_idx` argument in "
                                           r"`NoIndex.validation_step\(\)`.*dataloader_idx=0"):
        trainer.validate(NoIndex())
    with pytest.raises(RuntimeError, match=r"`HookNeedsIndex.on_validation_batch_end\(\)`"):
        trainer.validate(HookNeedsIndex())
    assert len(trainer.validate(Ignores(), verbose=False)) == 2


def test_a_combined_evaluation_loader_reports_each_loaders_batches(make_trainer: Any) -> None:
    seen: list[Any] = []

    class Combined(TinyModule):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append(batch)

    trainer = make_trainer(max_epochs=1)
    trainer.validate(Combined(), CombinedLoader({"a": [0, 1, 2], "b": [3, 4]}, "max_size"))
    assert seen == [{"a": 0, "b": 3}, {"a": 1, "b": 4}, {"a": 2, "b": None}]  # plain lists are iterables
    assert trainer.num_val_batches == [3, 2] and trainer.num_sanity_val_batches == []


def test_each_loaders_results_hold_what_was_logged_under_it(make_trainer: Any) -> None:
    class Logs(TinyModule):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
            self.log("loss", loss, on_step=True, on_epoch=True)
            self.log(f"only_{dataloader_idx}", float(dataloader_idx + 1), add_dataloader_idx=False)
            self.log("seen", 1.0, reduce_fx="sum", add_dataloader_idx=False)  # under both: the whole pass's

        def on_test_epoch_end(self) -> None:
            self.log("at_end", 7.0)

        def test_dataloader(self) -> list[DataLoader]:
            return [DataLoader(self.val_ds, batch_size=4)] * 2

    results = make_trainer().test(Logs(val_n=8), verbose=False)
    assert [sorted(r) for r in results] == [
        ["at_end", "loss_epoch/dataloader_idx_0", "only_0", "seen"],
        ["at_end", "loss_epoch/dataloader_idx_1", "only_1", "seen"]]  # the tag before the loader's suffix
    assert results[1]["only_1"] == 2.0 and results[0]["seen"] == results[1]["seen"] == 4.0


def test_a_name_holding_the_loader_suffix_is_refused(make_trainer: Any) -> None:
    class Suffixed(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("foo/dataloader_idx_0", 1.0)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="`self.log` with the key `foo/dataloader_idx_0` but it should not "
                                         "contain information about `dataloader_idx`"):
        make_trainer(max_epochs=1).fit(Suffixed(val_n=None))


def test_a_none_batch_is_skipped_with_a_warning_on_one_process(make_trainer: Any) -> None:
    from torch.utils.data import default_collate

    ends: list[Any] = []

    class Holes(TinyModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_ds, batch_size=4,
                              collate_fn=lambda items: None if len(ends) % 2 == 0 else default_collate(items))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            ends.append(outputs)

    trainer = make_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="train_dataloader yielded None"):
        trainer.fit(Holes(n=16, val_n=None))
    assert trainer.global_step == 2 and [o is None for o in ends] == [True, False, True, False]


def _none_batch_worker(rank: int, world_size: int, root: str) -> str:
    from polytrain import Trainer

    class Holes(TinyModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_ds, batch_size=2, collate_fn=lambda items: None)

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=world_size, run_dir=root, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, max_epochs=1, timeout=60)
    try:
        trainer.fit(Holes(n=8, val_n=None))
    except ValueError as err:
        return str(err)
    return "trained"


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_none_batch_under_ddp_is_an_error_on_every_rank_that_meets_it(tmp_path: Any) -> None:
    from distributed import run_distributed

    said = run_distributed(_none_batch_worker, 2, str(tmp_path))
    assert all("yielded None at batch 0 of epoch 0" in s and "every rank must step together" in s
               for s in said), said
