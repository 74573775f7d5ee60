"""``fit``: the epoch loop, in Lightning's order.

    configure_callbacks, prepare_data, setup("fit"), configure_model, configure_optimizers,
    [resume], on_fit_start, sanity check (RNG isolated), train_dataloader, on_train_start,
    per epoch: on_train_epoch_start, batches, validation, on_train_epoch_end; on_train_end, on_fit_end,
    teardown("fit").

Per batch the loop adds no host-device sync of its own: values leave the device only on logging
steps, and decisions that change control flow are reduced across ranks. What is constant for the
run (hook plans, the optimisation mode, whether a heartbeat runs) is fixed before the first batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import heartbeat
from polytrain.core.errors import ConfigError, EmptyDataError
from polytrain.core.rng import isolate_rng, training_streams
from polytrain.trainer.data_connector import (
    NO_BATCH,
    AgreedBatches,
    batch_limit,
    disabled,
    epoch_iterator,
    loader_source,
    request_loader,
)
from polytrain.trainer.evaluation import run_eval_pass
from polytrain.trainer.guards import check_batches
from polytrain.trainer.hooks import defines
from polytrain.trainer.module import TrainModule
from polytrain.trainer.optim import step_schedulers
from polytrain.trainer.optimization import AutomaticOptimization, ManualOptimization

if TYPE_CHECKING:
    from polytrain.trainer.trainer import Trainer

EPOCH_ONLY = (False, True)  # self.log defaults in epoch-level hooks
PER_STEP = (True, False)  # in training_step and the batch-level hooks

log = logging.getLogger("polytrain")


def run_fit(trainer: Trainer) -> None:
    cfg, hooks = trainer.config, trainer.hooks
    trainer.train_loader = None  # this fit's, requested after the sanity check (or by estimated_stepping_batches)
    trainer.setup_optimizers()
    trainer.restore_checkpoint_for_fit()
    hooks("on_fit_start")
    sanity = (cfg.num_sanity_val_steps != 0 and not cfg.fast_dev_run and loader_source(trainer, "val") is not None
              and defines(trainer.module, "validation_step", TrainModule) and not disabled(trainer, "val"))
    if sanity:
        _sanity_check(trainer)
    if disabled(trainer, "train"):  # limit_train_batches=0: as Lightning, the fit is its sanity check
        hooks("on_fit_end")
        return
    if not trainer.__dict__.pop("train_loader_early", False):  # estimated_stepping_batches may have asked
        trainer.train_loader = request_loader(trainer, "train")
    if trainer.train_loader is None:
        raise ValueError(f"no training data: pass train_dataloaders to fit() or define train_dataloader() on "
                         f"{type(trainer.module).__name__} (or its DataModule)")
    # Iterable-style data (``agreed``): ranks agree before each batch and end the epoch together.
    trainer.num_training_batches, agreed = check_batches(trainer, trainer.train_loader, "train",
                                                         batch_limit(trainer, "train", trainer.train_loader))
    # Training steps get a stream per data-parallel rank (tensor/pipeline peers of a replica share it),
    # and sharded regions (polytrain.layers.sharded_rng) one per global rank.
    training_streams(cfg.seed, trainer.strategy.dp_rank, trainer.strategy.global_rank)
    trainer.train_batch_size = getattr(trainer.train_loader, "batch_size", None)
    loop = EpochLoop(trainer, agreed)
    trainer.profiler.start(loop)  # trainer.profiler: instruments once; the default does nothing
    loop.first_iterator = epoch_iterator(trainer, trainer.train_loader, trainer.current_epoch)
    if not sanity:  # as Lightning: without a sanity check the val loader is asked for here
        _request_val(trainer)
    trainer.metrics.start_stage("train", EPOCH_ONLY)
    hooks("on_train_start")
    trainer.should_stop = False
    while not loop.done():
        loop.run_epoch()
        loop.agree_at_epoch_end()
    trainer.guard.check()
    trainer.metrics.start_stage(None)
    hooks("on_train_end")
    hooks("on_fit_end")
    trainer.profiler.stop()


def _request_val(trainer: Trainer) -> None:
    trainer.val_loader = None if disabled(trainer, "val") else request_loader(trainer, "val")
    trainer.num_val_batches = batch_limit(trainer, "val", trainer.val_loader) if trainer.val_loader is not None \
        else 0


def _sanity_check(trainer: Trainer) -> None:
    """A few validation batches before training, so a bug in ``validation_step`` shows in seconds, not
    after an epoch. Its random draws are undone and its metrics dropped (Lightning's order: the
    hooks, then the val loader is asked for, all without gradients)."""
    steps = trainer.config.num_sanity_val_steps
    with isolate_rng():
        trainer.sanity_checking = True
        trainer.hooks.callbacks_only("on_sanity_check_start")
        try:
            with torch.no_grad():
                _request_val(trainer)
            if trainer.val_loader is not None:
                limit = trainer.num_val_batches if steps == -1 else min(steps, trainer.num_val_batches or steps)
                if limit:
                    run_eval_pass(trainer, trainer.val_loader, "val", limit, sanity=True)
        finally:
            trainer.sanity_checking = False
        trainer.hooks.callbacks_only("on_sanity_check_end")


class EpochLoop:
    def __init__(self, trainer: Trainer, agreed: bool = False) -> None:
        self.trainer = trainer
        self.agreed = agreed  # iterable-style training data: batches agreed across ranks (AgreedBatches)
        cfg = trainer.config
        self.max_epochs = cfg.max_epochs if cfg.max_epochs is not None else (1000 if cfg.max_steps < 0 else 10**9)
        if cfg.fast_dev_run:
            self.max_epochs = 1
        self.started = time.monotonic()
        self.max_seconds = trainer.max_time_seconds
        self.first_iterator: tuple[Any, int] | None = None
        self.optimization = (AutomaticOptimization(trainer) if trainer.module.automatic_optimization
                             else ManualOptimization(trainer))
        trainer._automatic = self.optimization
        self.val_every = val_check_batches(trainer)
        self.out_of_time = False
        # A stop request (trainer.should_stop) is acted on after the batch that made it, once min_epochs and
        # min_steps are met. One process reads it directly; ranks act on the value they last agreed on (at
        # logging steps, after a validation, at the epoch's end), so a request made on one rank cannot split them.
        self.multi_rank = trainer.world_size > 1
        self.stop_agreed = False
        self.validate_on_stop = False
        self.loaded_epoch = {"train": trainer.current_epoch, "val": trainer.current_epoch}  # reload_dataloaders_...
        self._told_min = False

    def time_up(self) -> bool:
        """``max_time`` reached on this rank (reduce across ranks before acting on it)."""
        return self.max_seconds is not None and time.monotonic() - self.started >= self.max_seconds

    def done(self) -> bool:
        t, cfg = self.trainer, self.trainer.config
        finished = t.current_epoch >= self.max_epochs or (0 <= cfg.max_steps <= t.global_step) or self.out_of_time
        return finished or (t.should_stop and self.min_reached())

    def min_reached(self) -> bool:
        """A stop request waits (stays pending) until min_epochs and min_steps are met."""
        t, cfg = self.trainer, self.trainer.config
        reached = t.current_epoch >= (cfg.min_epochs or 0) and t.global_step >= (cfg.min_steps or 0)
        if not reached and not self._told_min:
            self._told_min = True
            log.info("trainer.should_stop was set but min_epochs=%s / min_steps=%s are not reached yet: training "
                     "continues until they are", cfg.min_epochs, cfg.min_steps)
        return reached

    def agree_at_epoch_end(self) -> None:
        t = self.trainer
        if self.max_seconds is not None and t.strategy.reduce_boolean_decision(self.time_up()):
            t.should_stop = self.out_of_time = True
        t.should_stop = self.stop_agreed = t.strategy.reduce_boolean_decision(t.should_stop)

    def _agree_on_stop(self) -> None:
        """At a point every rank reaches together (logging step, validation): agree on a stop request."""
        if self.multi_rank:
            self.stop_agreed = self.trainer.should_stop = self.trainer.strategy.reduce_boolean_decision(
                self.trainer.should_stop)

    def run_epoch(self) -> None:
        t = self.trainer
        iterator, start = self._iterator()
        self.validate_on_stop = False
        epoch_complete = self._run_batches(iterator, start)
        t.epoch_complete = epoch_complete
        if epoch_complete and t.val_loader is not None and (self._validates_at_epoch_end() or self.validate_on_stop):
            self.validate()
        self._end_epoch(epoch_complete)

    def _iterator(self) -> tuple[Any, int]:
        t = self.trainer
        if self.first_iterator is not None:
            t.metrics.start_stage("train", EPOCH_ONLY)
            t.hooks("on_train_epoch_start")
            iterator, self.first_iterator = self.first_iterator, None
            return iterator
        if self._reload_due("train"):
            t.train_loader = request_loader(t, "train")
        t.metrics.start_stage("train", EPOCH_ONLY)
        t.hooks("on_train_epoch_start")
        return epoch_iterator(t, t.train_loader, t.current_epoch)

    def _run_batches(self, iterator: Any, start: int) -> bool:
        """The epoch's batches from ``start``; True if it ran to its end (no stop mid-epoch).

        Sized loaders take ``num_batches`` batches. Iterable-style ones go through ``AgreedBatches``: the
        epoch ends at the shortest rank's stream (or the limit), and its last batch closes its window."""
        t, cfg = self.trainer, self.trainer.config
        num_batches, accumulate = t.num_training_batches, cfg.accumulate_grad_batches
        run, metrics = self.optimization.run, t.metrics
        start_hooks, end_hooks = t.hooks.batch_plan("on_train_batch_start"), t.hooks.batch_plan("on_train_batch_end")
        automatic, log_every, epoch = t.module.automatic_optimization, cfg.log_every_n_steps, t.current_epoch
        multi_rank = self.multi_rank
        stepped = False
        transfer, beat = t.transfer_batch, heartbeat.beat if t.world_size > 1 else None
        metrics.defaults = PER_STEP
        stop = num_batches if num_batches is not None else 2**62
        agreed = AgreedBatches(iterator, t.strategy.reduce_boolean_decision) if self.agreed else None
        # Fixed for the epoch, so the common batch tests one flag instead of calling out.
        validates_inside = bool(self.val_every) and t.val_loader is not None and (
            num_batches is None or self.val_every < num_batches or cfg.check_val_every_n_epoch is None)
        schedulers = bool(t.lr_scheduler_configs)
        release_gradients = self.optimization.release_gradients  # a plain plan's zero_grad, before each fetch
        batch_idx = start
        for batch_idx in range(start, stop):
            if release_gradients is not None:
                release_gradients()
            if agreed is None:
                batch = next(iterator)
                last = batch_idx + 1 == num_batches
            else:
                batch, last = agreed.take(batch_idx + 1 < stop)
                if batch is NO_BATCH:  # every rank learnt together that some stream has ended
                    if batch_idx == 0:
                        raise EmptyDataError(
                            f"the training DataLoader yielded no batch in epoch {epoch} on at least one "
                            f"data-parallel rank; an iterable dataset must yield a batch on every rank every epoch")
                    break
            batch = transfer(batch)
            metrics.batch = batch  # its size is read only if a value is logged per epoch
            t.batch_in_epoch = batch_idx + 1
            end_of_window = (batch_idx + 1) % accumulate == 0 or last
            if beat is not None:
                beat(t.global_step, "training_step")
            if start_hooks and any([fn(batch, batch_idx) == -1 for fn in start_hooks]):
                return False  # on_train_batch_start returned -1: the rest of the epoch is skipped
            output = run(batch, batch_idx, end_of_window, epoch)
            stepped = automatic and end_of_window and not t.skip_this_step
            if stepped:
                t.global_step += 1
                if schedulers:
                    self._after_optimizer_step(last)
            if stepped or not automatic:
                t.batches_stepped += 1
                if t.batches_stepped % log_every == 0:
                    self._logging_step()
            if end_hooks:
                outputs = _batch_outputs(output, automatic)
                for fn in end_hooks:
                    fn(outputs, batch, batch_idx)
            validated = False
            if validates_inside and not last and self._validates_after(batch_idx):
                self.validate()
                metrics.start_stage("train", PER_STEP)
                validated = True
            if 0 <= cfg.max_steps <= t.global_step or self.out_of_time:
                return last
            if not last and (self.stop_agreed if multi_rank else t.should_stop) and self.min_reached():
                # As Lightning: the epoch ends here, validating first if this batch did not (and the epoch does).
                self.validate_on_stop = not validated and self._epoch_validates()
                return True
        return True

    def _logging_step(self) -> None:
        """Every ``log_every_n_steps``: per-step values to the loggers, then the losses' NaN check, the time
        limit and a stop request (a callback's ``on_log`` may make one) agreed in the check's one gather.
        Every rank gets here at the same step, so the collectives inside stay matched. The parameters are
        checked before each checkpoint and at the end, not here: one made non-finite by a step makes the
        next loss non-finite, and the pass over them cost ~100 us of a logging step (default benchmark)."""
        t = self.trainer
        t.publish(t.metrics.pop_step_values(t.strategy.dp_group), t.global_step)
        stop, time_up = t.guard.check((t.should_stop, self.time_up()), parameters=False)
        if time_up:  # max_time: every rank stops here; the fit-end checkpoint lets a resubmitted job continue
            t.should_stop = self.out_of_time = True
        if self.multi_rank:
            self.stop_agreed = t.should_stop = stop or time_up

    def _after_optimizer_step(self, last_batch: bool) -> None:
        t = self.trainer
        step_schedulers(t.lr_scheduler_configs, "step", t.global_step, t.callback_metrics, t.scheduler_step)
        if last_batch:  # Lightning's order: epoch schedulers after the epoch's last update
            step_schedulers(t.lr_scheduler_configs, "epoch", t.current_epoch + 1, t.callback_metrics,
                            t.scheduler_step, plateau=False)

    def _validates_after(self, batch_idx: int) -> bool:
        """Validation inside the epoch (``val_check_interval``), not at its end."""
        t, every = self.trainer, self.val_every  # not at the epoch's last batch: _validates_at_epoch_end decides
        if t.config.check_val_every_n_epoch is None:  # an interval counted across epochs
            return (t.current_epoch * (t.num_training_batches or 0) + batch_idx + 1) % every == 0
        if (t.current_epoch + 1) % t.config.check_val_every_n_epoch:
            return False
        return (batch_idx + 1) % every == 0

    def _validates_at_epoch_end(self) -> bool:
        t = self.trainer
        every_n = t.config.check_val_every_n_epoch
        if t.num_training_batches is None:  # an epoch of unknown length: validation at its end, or by count
            return self.val_every == 0 and every_n is not None and (t.current_epoch + 1) % every_n == 0
        if every_n is None:
            return (t.current_epoch + 1) * (t.num_training_batches or 0) % self.val_every == 0
        return (t.current_epoch + 1) % every_n == 0 and (t.num_training_batches or 0) % self.val_every == 0

    def _epoch_validates(self) -> bool:
        every_n = self.trainer.config.check_val_every_n_epoch
        return every_n is None or (self.trainer.current_epoch + 1) % every_n == 0

    def _reload_due(self, stage: str) -> bool:
        """``reload_dataloaders_every_n_epochs``: the loader was last requested that many epochs ago."""
        t, every = self.trainer, self.trainer.config.reload_dataloaders_every_n_epochs
        if not every or t.current_epoch - self.loaded_epoch[stage] < every:
            return False
        self.loaded_epoch[stage] = t.current_epoch
        return True

    def validate(self) -> None:
        t = self.trainer
        if self._reload_due("val"):  # before the validation, as Lightning
            _request_val(t)
        if t.num_val_batches == 0:  # None: a loader without length, run until it ends
            return
        with t.metrics.refusing("on_validation_model_zero_grad"):
            t.hooks("on_validation_model_zero_grad")
        run_eval_pass(t, t.val_loader, "val", t.num_val_batches)
        self._agree_on_stop()  # e.g. EarlyStopping after a validation inside the epoch

    def _end_epoch(self, epoch_complete: bool) -> None:
        t = self.trainer
        heartbeat.at("train_epoch_end")
        t.metrics.start_stage("train", EPOCH_ONLY)
        t.at_epoch_end = epoch_complete  # a checkpoint taken now resumes at the next epoch
        try:
            before, after, module_hook = t.hooks.plan("on_train_epoch_end")
            for fn in before:
                fn(t, t.module)
            if module_hook is not None:
                module_hook()
            # Epoch values after the module's hook (it may log there), before the callbacks that read them.
            t.publish(t.metrics.reduce_epoch("train", t.strategy.dp_group), t.global_step)
            for fn in after:
                fn(t, t.module)
        finally:
            t.at_epoch_end = False
        if epoch_complete:
            step_schedulers(t.lr_scheduler_configs, "epoch", t.current_epoch + 1, t.callback_metrics,
                            t.scheduler_step, plateau=True)
            # A mid-epoch stop (max_steps) keeps its position, so a checkpoint taken at fit end
            # resumes from the next batch instead of skipping the rest of the epoch.
            t.current_epoch += 1
            t.batch_in_epoch = 0


def _batch_outputs(output: Any, automatic: bool) -> Any:
    """What ``on_train_batch_end`` receives: under automatic optimisation ``{"loss": normalised loss,
    **the step's other keys}``; under manual, what ``training_step`` returned."""
    if not automatic:
        return output
    if output is None or output.output is None:
        return None
    raw = output.output
    extra = {k: v for k, v in raw.items() if k != "loss"} if isinstance(raw, dict) else {}
    return {"loss": output.loss, **extra}


def val_check_batches(trainer: Trainer) -> int:
    """Validate every this many training batches (the epoch length: at its end)."""
    cfg, n = trainer.config, trainer.num_training_batches
    interval = cfg.val_check_interval
    if interval is None or (isinstance(interval, float) and interval == 1.0):
        return n if n is not None else 0  # 0: an epoch of unknown length validates at its end only
    if isinstance(interval, float):
        if n is None:
            raise ConfigError(f"trainer.val_check_interval={interval} is a fraction of an epoch, but the training "
                              f"loader has no length; give a number of batches")
        return max(1, int(n * interval))
    if cfg.check_val_every_n_epoch is None and n is None:
        raise ConfigError(f"trainer.val_check_interval={interval} with check_val_every_n_epoch=null counts batches "
                          f"across epochs, but the training loader has no length (an IterableDataset?); set "
                          f"check_val_every_n_epoch, or trainer.limit_train_batches to fix the epoch's length")
    if cfg.check_val_every_n_epoch is not None and n is not None and interval > n:
        raise ConfigError(f"trainer.val_check_interval={interval} is more than the {n} training batches of an "
                          f"epoch; lower it, or set check_val_every_n_epoch=null to count across epochs")
    return int(interval)
