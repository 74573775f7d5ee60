"""``fit``: the epoch loop, in Lightning's order.

    configure_callbacks, prepare_data, setup("fit"), configure_model, configure_optimizers,
    [resume], on_fit_start, sanity check (RNG isolated), train_dataloader, on_train_start,
    per epoch: on_train_epoch_start, its batches (``TrainingEpochLoop``, loops/training_epoch.py),
    validation at the epoch's end, on_train_epoch_end;
    on_train_end, on_fit_end, teardown("fit").

``FitLoop`` owns the loop state (``trainer/loops/progress.py``), changed only through its own methods.
Decisions that change control flow are reduced across ranks. What is constant for the fit (the batch
step, hook plans, the validation schedule, the epoch loop) is fixed before the first epoch.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from polytrain.core import heartbeat
from polytrain.core.errors import ConfigError, first_few
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.core.rng import isolate_rng, training_streams, user_seed
from polytrain.core.states import RunningStage, TrainerState
from polytrain.data.loaders import stop_workers
from polytrain.parallel.float8 import precompute_scales_after_each_step, resolve_float8
from polytrain.trainer.api.hooks import Hooks, is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.api.optimizer_config import check_scheduler_api, parse_optimizers, step_schedulers
from polytrain.trainer.configuration.config_file import parse_duration
from polytrain.trainer.loops.data_connector import DataConnector, epoch_iterator
from polytrain.trainer.loops.evaluation import EvaluationLoop
from polytrain.trainer.loops.guards import NonFiniteGuard, check_batches
from polytrain.trainer.loops.optimization import AutomaticOptimization, ManualOptimization
from polytrain.trainer.loops.progress import EpochData, FitProgress, Resumed, Stopping
from polytrain.trainer.loops.schedule import ValidationSchedule
from polytrain.trainer.loops.training_epoch import TrainingEpochLoop
from polytrain.trainer.observability.goodput import Goodput, report_goodput
from polytrain.trainer.observability.metrics import MetricCollector, publish
from polytrain.trainer.persistence.resume import restore_fit

if TYPE_CHECKING:
    from polytrain.trainer.configuration.config import TrainerConfig
    from polytrain.trainer.observability.profiler import PassThroughProfiler


EPOCH_ONLY = (False, True)  # self.log defaults in epoch-level hooks

log = logging.getLogger("polytrain")


@dataclass(eq=False, repr=False)  # live objects handed over once: no comparison, no dump
class FitCollaborators:
    """What a fit works with, each named: the Trainer gathers them for every fit (``Trainer`` builds the
    strategy, the stage's hook funnel and loaders), and the loop reaches nothing else."""

    strategy: Any
    hooks: Hooks
    metrics: MetricCollector
    profiler: PassThroughProfiler
    loaders: DataConnector  # where the stage's loaders come from, and how many batches of each
    evaluation: EvaluationLoop  # validation passes
    transfer_batch: Callable[[Any], Any]  # the stage's batch mover (transfer hooks or the strategy's)
    module: Any
    datamodule: Any
    callbacks: list[Any]
    loggers: list[Any]  # the logging rank's (goodput's scalars go there); empty on the other ranks
    log_dir: str  # the run's directory


class FitLoop:
    """A Trainer's fits: their position (``progress``), stop requests, what a resume left, the loaders.
    Built with the Trainer's options; each fit brings its collaborators (``FitCollaborators``)."""

    def __init__(self, config: TrainerConfig, state: TrainerState) -> None:
        self.config = config  # the Trainer's options: max_epochs and min_epochs below read and write them
        self.state = state  # trainer.state: the sanity check sets its stage
        self.progress = FitProgress()
        self.stopping = Stopping()
        self.resumed = Resumed()
        self.data = EpochData()
        self.guard: NonFiniteGuard | None = None
        self.optimization: AutomaticOptimization | ManualOptimization | None = None
        self.schedule: ValidationSchedule | None = None
        self.epoch_loop: TrainingEpochLoop | None = None  # an epoch's batches, built for each fit
        self.lr_scheduler_configs: list[Any] = []
        self.goodput = Goodput()
        self._take(None)

    def _take(self, collaborators: FitCollaborators | None) -> None:
        """This fit's collaborators (None: before the first fit), and its time limit."""
        self.fit = collaborators
        max_time = self.config.max_time
        self._max_time = parse_duration(max_time) if max_time is not None else None

    # Lightning's trainer.fit_loop.max_epochs / min_epochs: raised between two fits, the second trains on.
    @property
    def max_epochs(self) -> int | None:
        return self.config.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: int | None) -> None:
        self.config.max_epochs = value

    @property
    def min_epochs(self) -> int | None:
        return self.config.min_epochs

    @min_epochs.setter
    def min_epochs(self, value: int | None) -> None:
        self.config.min_epochs = value

    # Lightning's trainer.fit_loop.batch_idx: the newest training batch's index in its epoch (the last
    # epoch's once it ended); total_batch_idx counts across epochs. -1 before the first batch.
    @property
    def batch_idx(self) -> int:
        return self.progress.batch_index

    @property
    def total_batch_idx(self) -> int:
        return self.progress.total_batches - 1

    # ------------------------------------------------------------------ the fit
    def run(self, collaborators: FitCollaborators, ckpt_path: str | None) -> None:
        self._take(collaborators)
        self._first: tuple[Any, int] | None = None  # the first epoch's iterator, made before on_train_start
        try:
            self._fit(ckpt_path)
        finally:
            # However the fit ends, its loaders' workers stop now, not when the loop is collected.
            data = self.data
            if self._first is not None:
                stop_workers(self._first[0], data.train_loader, keep_persistent=False)
            stop_workers(None, data.train_loader, keep_persistent=False)
            for loader in data.val_loaders:
                stop_workers(None, loader, keep_persistent=False)

    def _fit(self, ckpt_path: str | None) -> None:
        cfg, fit, data = self.config, self.fit, self.data
        hooks, strategy, loaders = fit.hooks, fit.strategy, fit.loaders
        # This fit's loader (estimated_stepping_batches may ask for it before the fit does).
        data.train_loader, data.requested_early = None, False
        self._setup_optimization()
        self._restore(ckpt_path)
        # the same on every rank (each restored the same loop state)
        if cfg.max_epochs not in (None, -1) and self.progress.epoch > cfg.max_epochs:
            raise ConfigError(f"You restored a checkpoint with current_epoch={self.progress.epoch}, but you "
                              f"have set Trainer(max_epochs={cfg.max_epochs}): the fit would train nothing. "
                              f"Raise max_epochs above {self.progress.epoch} to continue it, or start from "
                              f"the weights alone (module.load_from_checkpoint, or trainer.init_weights)")
        staging_waited = strategy.checkpoint_io.staging_waited()
        record_dir = fit.log_dir if strategy.is_logging_rank and os.path.isdir(fit.log_dir) else None
        self.goodput.begin(self.progress.global_step, staging_waited, record_dir)
        hooks("on_fit_start")
        validates = is_overridden(fit.module, "validation_step", TrainModule)
        if not validates and loaders.source("val") is not None and not loaders.disabled("val"):
            # Lightning's words for a loader that nothing will read
            rank_zero_warn("You passed in a `val_dataloader` but have no `validation_step`. "
                           "Skipping val loop.")
        sanity = (cfg.num_sanity_val_steps != 0 and not cfg.fast_dev_run
                  and loaders.source("val") is not None and validates
                  and not loaders.disabled("val"))
        # The epoch each loader was last requested in (reload_dataloaders_every_n_epochs); the val loader
        # counts from its first request for a validation (the sanity check's counts when epoch 0 validates).
        self._loaded = {"train": self.progress.epoch, "val": -math.inf}
        if sanity:
            self._sanity_check()
        if loaders.disabled("train"):  # limit_train_batches=0: as Lightning, the fit is its sanity check
            hooks("on_fit_end")
            return
        if not data.requested_early:
            data.train_loader = self.request_train_loader()
        if data.train_loader is None:
            raise ValueError(f"no training data: pass train_dataloaders to fit() or define "
                             f"train_dataloader() on {type(fit.module).__name__} (or its DataModule)")
        # Iterable-style data (``agreed``): ranks agree before each batch and end the epoch together.
        limit = loaders.batch_limit("train", data.train_loader)
        data.num_training_batches, self.agreed = check_batches(strategy, data.train_loader, "train",
                                                               limit)
        batches, every = data.num_training_batches, cfg.log_every_n_steps
        if fit.loggers and batches is not None and batches < every and not cfg.fast_dev_run:
            rank_zero_warn(f"The number of training batches ({batches}) is smaller than the logging "
                           f"interval Trainer(log_every_n_steps={every}): set a lower value for "
                           f"log_every_n_steps to see logs within each training epoch")
        # Training steps get a stream per data-parallel rank (tensor/pipeline peers of a replica share it),
        # and sharded regions (polytrain.layers.sharded_rng) one per global rank.
        lightning_seed = user_seed() if strategy.world_size > 1 else None  # the user's seed_everything
        training_streams(cfg.seed, strategy.dp_rank, strategy.global_rank, lightning_seed)
        self.schedule = ValidationSchedule(cfg, data.num_training_batches)
        self.progress.settle_total(data.num_training_batches)
        self._started, self._multi_rank = time.monotonic(), strategy.world_size > 1
        # As Lightning, a fit that starts past epoch 0 without a checkpoint (a second fit of this Trainer)
        # asks the loader for a new iterator when its first epoch starts: the one made here is dropped then.
        self._renew_first = self.progress.epoch > 0 and self.resumed.loop is None
        self._first = self._epoch_iterator()
        if not sanity:  # as Lightning: without a sanity check the val loader is asked for here when the
            if self._epoch_validates() or self._val_skipped():  # first epoch validates, else at the
                self._request_val()  # first validation
            else:
                data.defer_val()
        fit.metrics.start_stage("train", EPOCH_ONLY)
        in_eval = [name or type(fit.module).__name__ for name, m in fit.module.named_modules()
                   if not m.training]
        if in_eval:  # as Lightning: a frozen BatchNorm left in eval mode is fine; a whole model is likely not
            rank_zero_warn(f"Found {len(in_eval)} module(s) in eval mode at the start of training "
                           f"({first_few(in_eval)}): they train as they are (dropout off, BatchNorm "
                           f"statistics frozen). If this is intentional, you can ignore this warning")
        hooks("on_train_start")
        self.stopping.reset()
        self.schedule.start(self.progress.total_batches)  # a duration counts from here
        if cfg.fast_dev_run:
            self._max_epochs: float = 1
        elif cfg.max_epochs == -1:  # no limit: until max_steps, max_time or a stop request
            self._max_epochs = math.inf
        elif cfg.max_epochs is not None:
            self._max_epochs = cfg.max_epochs
        else:  # as Lightning: 1000 epochs unless max_steps bounds the fit
            self._max_epochs = 1000 if cfg.max_steps < 0 else math.inf
            if cfg.max_steps < 0 and cfg.max_time is None:
                rank_zero_warn("trainer.max_epochs was not set: the fit stops after 1000 epochs (as "
                               "Lightning's); set max_epochs=-1 to train without an epoch limit")
        self.epoch_loop = TrainingEpochLoop(
            fit, config=cfg, progress=self.progress, stopping=self.stopping, data=data,
            goodput=self.goodput, optimization=self.optimization, guard=self.guard, schedule=self.schedule,
            schedulers=self.lr_scheduler_configs, agreed=self.agreed, multi_rank=self._multi_rank,
            validate=self._validate, time_up=self._time_up, min_reached=self._min_reached,
            scheduler_step=self._scheduler_step)
        while not self._done():
            with self.goodput.phase("epoch"), fit.profiler.phase("train epoch"):
                self._run_epoch()
            self._agree_at_epoch_end()
        self.guard.check()
        fit.metrics.start_stage(None)
        hooks("on_train_end")
        hooks("on_fit_end")
        staging_waited = strategy.checkpoint_io.staging_waited()
        report_goodput(self.goodput, self.progress.global_step, staging_waited, strategy.is_global_zero,
                       fit.loggers)

    def validates_this_epoch(self) -> bool:
        """Whether the current epoch runs a validation (``check_val_every_n_epoch``, a validation loader)."""
        return self.schedule is not None and self.data.has_val() and self.schedule.epoch_validates(
            self.progress.epoch)

    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps ``fit`` will take (Lightning's ``trainer.estimated_stepping_batches``). As
        Lightning, asking before training requests the training loader early (this fit then uses that
        loader); a loader without length gives ``inf``."""
        cfg, data = self.config, self.data
        if data.train_loader is None:
            data.train_loader, data.requested_early = self.request_train_loader(), True
        loader = data.train_loader
        batches = self.fit.loaders.batch_limit("train", loader) if loader is not None else 0
        if cfg.fast_dev_run:
            epochs: float = 1
        elif cfg.max_epochs == -1:
            epochs = float("inf")
        elif cfg.max_epochs is not None:
            epochs = cfg.max_epochs
        else:
            epochs = 1000 if cfg.max_steps < 0 else float("inf")
        if batches is None:
            steps: float = float("inf")
        else:
            steps = math.ceil(batches / cfg.accumulate_grad_batches) * max(epochs, 1)
        return min(steps, cfg.max_steps) if cfg.max_steps >= 0 else steps

    def request_train_loader(self) -> Any:
        saved = self.resumed.loop
        return self.fit.loaders.request("train", saved.get("dp_size") if saved is not None else None)

    def _setup_optimization(self) -> None:
        """configure_optimizers, then the fit's batch step. As Lightning, every fit builds its optimizers
        anew: a second fit of the same Trainer (a fine-tuning or SWA phase) starts from fresh optimizer state
        unless it resumes a checkpoint."""
        strategy, module, hooks, cfg = self.fit.strategy, self.fit.module, self.fit.hooks, self.config
        optimizers, self.lr_scheduler_configs = parse_optimizers(hooks.module("configure_optimizers"),
                                                                 module.automatic_optimization)
        check_scheduler_api(self.lr_scheduler_configs, module,
                            is_overridden(module, "lr_scheduler_step", TrainModule))
        strategy.setup_optimizers(optimizers)
        float8 = resolve_float8(cfg.float8)
        if float8 is not None and float8["precompute_float8_dynamic_scale_for_fsdp"]:
            precompute_scales_after_each_step(module, optimizers)
        if not module.automatic_optimization and cfg.gradient_clip_val is not None:
            raise ConfigError(f"trainer.gradient_clip_val={cfg.gradient_clip_val} does nothing under "
                              f"manual optimisation ({type(module).__name__}.automatic_optimization is "
                              f"False): call self.clip_gradients(optimizer, gradient_clip_val=..., "
                              f"gradient_clip_algorithm=...) in training_step before optimizer.step(), and "
                              f"drop the option")
        self.progress.start_fit(strategy.world_size, strategy.dp_size)
        self.guard = NonFiniteGuard(cfg.nan_policy, strategy, module, self.progress)
        phase = self.fit.profiler.phase
        if module.automatic_optimization:
            self.optimization = AutomaticOptimization(strategy, module, hooks, self.guard, cfg, phase)
        else:
            # Manual optimisation steps inside training_step: each step counts as it is taken.
            self.optimization = ManualOptimization(strategy, hooks, self.guard,
                                                   self.progress.count_optimizer_step, phase)

    def _restore(self, ckpt_path: str | None) -> None:
        """Resume from the checkpoint settled with the run's directory (the same on every rank): every
        step of it is ``resume.restore_fit``'s; the first epoch takes back what it returns."""
        if ckpt_path is not None:
            self.resumed = restore_fit(ckpt_path, strategy=self.fit.strategy, hooks=self.fit.hooks,
                                       module=self.fit.module, datamodule=self.fit.datamodule,
                                       callbacks=self.fit.callbacks, schedulers=self.lr_scheduler_configs,
                                       progress=self.progress)
        self.guard.resume_at(self.progress.global_step)  # errors name steps from the resumed count

    # ------------------------------------------------------------------ stopping
    def _time_up(self) -> bool:  # max_time reached on this rank (reduce across ranks before acting on it)
        limit = self._max_time
        return limit is not None and time.monotonic() - self._started >= limit

    def _done(self) -> bool:
        p, s, max_steps = self.progress, self.stopping, self.config.max_steps
        finished = p.epoch >= self._max_epochs or (0 <= max_steps <= p.global_step) or s.out_of_time
        return finished or (s.requested and self._min_reached())

    def _min_reached(self) -> bool:
        """A stop request waits (stays pending) until min_epochs and min_steps are met."""
        cfg, p = self.config, self.progress
        reached = p.epoch >= (cfg.min_epochs or 0) and p.global_step >= (cfg.min_steps or 0)
        if not reached and self.stopping.first_wait_for_min():
            log.info("trainer.should_stop was set but min_epochs=%s / min_steps=%s are not reached yet: "
                     "training continues until they are", cfg.min_epochs, cfg.min_steps)
        return reached

    def _agree_at_epoch_end(self) -> None:
        s, strategy = self.stopping, self.fit.strategy
        if self._max_time is not None and strategy.reduce_boolean_decision(self._time_up()):
            s.time_up()
        s.agree(strategy.reduce_boolean_decision(s.requested))

    def _agree_on_stop(self) -> None:  # at a point every rank reaches together (logging step, validation)
        if self._multi_rank:
            s = self.stopping
            s.agree(self.fit.strategy.reduce_boolean_decision(s.requested))

    # ------------------------------------------------------------------ an epoch
    def _epoch_iterator(self) -> tuple[Any, int]:
        p, data = self.progress, self.data
        iterator, start, sample_base, data.loader_rng = epoch_iterator(
            data.train_loader, p.epoch, p.batch_in_epoch, data.num_training_batches,
            self.fit.strategy.dp_size, self.resumed)
        p.start_epoch(sample_base, getattr(data.train_loader, "batch_size", None))
        return iterator, start

    def _run_epoch(self) -> None:
        p, first = self.progress, None if self._renew_first else self._first
        if self._renew_first and self._first is not None:
            stop_workers(self._first[0], self.data.train_loader, keep_persistent=True)
        self._first = None
        if first is None and self._reload_due("train"):
            stop_workers(None, self.data.train_loader, keep_persistent=False)  # the loader being replaced
            self.data.train_loader = self.request_train_loader()
        self.fit.metrics.start_stage("train", EPOCH_ONLY)
        if first is None or not first[1]:  # as Lightning: an epoch resumed mid-way has already started
            self.fit.hooks("on_train_epoch_start")
        # The epoch's iterator after the hook, as Lightning.
        iterator, start = first if first is not None else self._epoch_iterator()
        if start and p.validation_due is None:  # a file from before the loop recorded it
            at_end = start == self.data.num_training_batches
            due = self.schedule.due_after(p.epoch, start - 1, p.total_batches, True, self.data.has_val())
            p.expect_validation(at_end and due)
        if start and p.validation_due and start != self.data.num_training_batches:
            self._validate()  # the checkpoint was taken between a batch and its validation
            self.fit.metrics.start_stage("train", EPOCH_ONLY)
        try:
            complete = self.epoch_loop.run(iterator, start)
        finally:  # before a validation starts workers of its own; persistent ones stay for the next epoch
            stop_workers(iterator, self.data.train_loader, keep_persistent=True)
        if complete and p.validation_due:
            self._validate()
        with self.fit.profiler.phase("epoch end"):
            self._finish_epoch(complete)

    def _scheduler_step(self, scheduler: Any, metric: Any) -> None:
        with self.fit.metrics.refusing("lr_scheduler_step"):
            self.fit.hooks.module("lr_scheduler_step", scheduler, metric)

    # ------------------------------------------------------------------ validation
    def _reload_due(self, stage: str) -> bool:
        """``reload_dataloaders_every_n_epochs``: the loader was last requested that many epochs ago."""
        every, epoch = self.config.reload_dataloaders_every_n_epochs, self.progress.epoch
        if not every or epoch - self._loaded[stage] < every:
            return False
        self._loaded[stage] = epoch
        return True

    def _epoch_validates(self) -> bool:
        every = self.config.check_val_every_n_epoch
        return every is None or (self.progress.epoch + 1) % every == 0

    def _val_skipped(self) -> bool:
        # As Lightning: without a validation_step nothing reads the loaders, and they are never asked for
        validates = is_overridden(self.fit.module, "validation_step", TrainModule)
        return self.fit.loaders.disabled("val") or not validates

    def _request_val(self) -> None:
        data, loaders = self.data, self.fit.loaders
        for loader in data.val_loaders:  # the loaders being replaced, if any
            stop_workers(None, loader, keep_persistent=False)
        val_loaders = [] if self._val_skipped() else loaders.request_eval("val")
        data.use_val(val_loaders, [loaders.batch_limit("val", loader) for loader in val_loaders])
        if self.state.stage != RunningStage.SANITY_CHECKING or self._epoch_validates():
            self._loaded["val"] = self.progress.epoch

    def _sanity_check(self) -> None:
        """A few validation batches before training, so a bug in ``validation_step`` shows in seconds, not
        after an epoch. Its random draws are undone and its metrics dropped (Lightning's order: the
        hooks, then the val loader is asked for, all without gradients)."""
        steps, hooks, data = self.config.num_sanity_val_steps, self.fit.hooks, self.data
        with isolate_rng():
            # As Lightning: both sanity hooks see trainer.sanity_checking
            self.state.stage = RunningStage.SANITY_CHECKING
            try:
                hooks.callbacks("on_sanity_check_start")
                with torch.no_grad():
                    self._request_val()
                # as Lightning: num_sanity_val_steps batches of each loader
                limits = [n if steps == -1 else min(steps, n if n is not None else steps)
                          for n in data.val_batches]
                if any(limits):
                    self._evaluate(data.val_loaders, limits, sanity=True)
                hooks.callbacks("on_sanity_check_end")
            finally:
                self.state.stage = RunningStage.TRAINING
            self.fit.metrics.reset()

    def _evaluate(self, loaders: list[Any], limits: list[int | None], sanity: bool = False) -> None:
        p = self.progress
        self.fit.evaluation.run(loaders, "val", limits, entry="fit", epoch=p.epoch, global_step=p.global_step,
                            sanity=sanity)

    def _validate(self) -> None:
        with self.goodput.phase("validation"), self.fit.profiler.phase("validation"):
            self._run_validation()

    def _run_validation(self) -> None:
        data = self.data
        self.progress.expect_validation(False)  # from here on, a checkpoint resumes after this validation
        if data.val_pending or self._reload_due("val"):  # before the validation, as Lightning
            self._request_val()
        if not data.has_val():
            return
        with self.fit.metrics.refusing("on_validation_model_zero_grad"):
            self.fit.hooks.module("on_validation_model_zero_grad")
        self._evaluate(data.val_loaders, data.val_batches)
        self.schedule.validated()
        self._agree_on_stop()  # e.g. EarlyStopping after a validation inside the epoch

    # ------------------------------------------------------------------ the epoch's end
    def _finish_epoch(self, complete: bool) -> None:
        """``on_train_epoch_end`` with this epoch's values already reduced (the hooks read them), what the
        module logs there reduced before the callbacks that watch metrics run, then the epoch schedulers."""
        p, metrics, hooks, group = self.progress, self.fit.metrics, self.fit.hooks, self.fit.strategy.dp_group
        heartbeat.at("train_epoch_end")
        # the values of the epoch's last steps, reduced where no logging step did it
        metrics.sync_fresh_step_values("train", group)
        metrics.start_stage("train", EPOCH_ONLY)
        with p.ending_epoch(complete):  # a checkpoint taken now resumes at the next epoch
            values = metrics.reduce_epoch("train", group)

            def reduced_and_published() -> None:
                values.update(metrics.reduce_epoch("train", group, more=True))
                publish(metrics, hooks, values, p.global_step)

            hooks.epoch_end("on_train_epoch_end", reduced_and_published)
        if complete:
            step_schedulers(self.lr_scheduler_configs, "epoch", p.epoch + 1, metrics.callback,
                            self._scheduler_step, plateau=True)
            # A mid-epoch stop (max_steps) keeps its position, so a checkpoint taken at fit end
            # resumes from the next batch instead of skipping the rest of the epoch.
            p.finish_epoch()

