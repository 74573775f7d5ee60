"""One training epoch's batches, in Lightning's order. Per batch:

    run_batch: fetch, move to the device, on_train_batch_start, the strategy's executor's train_step
        (forward, zero_grad, backward, clipping, the optimizer step: strategies/train_step.py), step-wise
        schedulers;
    every log_every_n_steps: the logging step (values published, the non-finite check, the time limit
        and a stop request agreed in one gather);
    the validation due flag, on_train_batch_end, a validation when due;
    a stop at max_steps, max_time or an agreed request (once min_epochs / min_steps are met).

``FitLoop`` builds one per fit with the collaborators it uses; what stays the fit's (validating, the
time limit, the minimum-epochs rule, stepping a scheduler through the module's hook) comes as callables.
Per batch the loop adds no host-device sync of its own; what each batch reads is looked up once an epoch
(``_start_epoch_steps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polytrain.core import heartbeat
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.trainer.api.optimizer_config import step_schedulers
from polytrain.trainer.loops.data_connector import NO_BATCH, agreed_batches
from polytrain.trainer.loops.guards import NonFiniteGuard
from polytrain.trainer.loops.optimization import AutomaticOptimization, ManualOptimization
from polytrain.trainer.loops.progress import EpochData, FitProgress, Stopping
from polytrain.trainer.loops.schedule import ValidationSchedule
from polytrain.trainer.observability.goodput import Goodput
from polytrain.trainer.observability.metrics import publish

if TYPE_CHECKING:
    from polytrain.trainer.loops.fit_loop import FitCollaborators

# What run_batch returns instead of a step when the epoch ends before it.
DATA_ENDED = "the data ran out"
EPOCH_SKIPPED = "on_train_batch_start returned -1"

PER_STEP = (True, False)  # self.log defaults in training_step and the batch-level hooks


class TrainingEpochLoop:
    """The batches of one epoch, for one fit: built by ``FitLoop`` once its optimizers, guard and validation
    schedule are known, with each collaborator named. Loop state changes only through ``progress``',
    ``stopping``'s and ``data``'s own methods."""

    def __init__(self, fit: FitCollaborators, *, config: Any, progress: FitProgress, stopping: Stopping,
                 data: EpochData, goodput: Goodput, optimization: AutomaticOptimization | ManualOptimization,
                 guard: NonFiniteGuard, schedule: ValidationSchedule, schedulers: list[Any], agreed: bool,
                 multi_rank: bool, validate: Callable[[], None], time_up: Callable[[], bool],
                 min_reached: Callable[[], bool], scheduler_step: Callable[[Any, Any], None]) -> None:
        self.fit = fit  # the fit's strategy, hooks, metrics, profiler, module and batch mover
        self.config = config
        self.progress = progress
        self.stopping = stopping
        self.data = data
        self.goodput = goodput
        self.optimization = optimization
        self.guard = guard
        self.schedule = schedule
        self.lr_scheduler_configs = schedulers
        self.agreed = agreed  # iterable-style data: the ranks agree before each batch
        self._multi_rank = multi_rank
        # The fit's own: a validation (with its clock and profiler rows), this rank's time limit, whether
        # min_epochs / min_steps let a stop happen, one scheduler step through lr_scheduler_step
        self._validate = validate
        self._time_up = time_up
        self._min_reached = min_reached
        self._scheduler_step = scheduler_step

    def run(self, iterator: Any, start: int) -> bool:
        """The epoch's batches from ``start``; True if it ran to its end (no stop mid-epoch). Per batch:
        ``run_batch``, the logging step when due, ``on_train_batch_end``, a validation when due, then
        whether to stop.

        Sized loaders take ``num_batches`` batches. Iterable-style ones go through ``AgreedBatches``: the
        epoch ends at the shortest rank's stream (or the limit), and its last batch closes its window."""
        cfg, p, stopping, schedule = self.config, self.progress, self.stopping, self.schedule
        metrics, end_hooks = self.fit.metrics, self.fit.hooks.batch_plan("on_train_batch_end")
        automatic, log_every = self.fit.module.automatic_optimization, cfg.log_every_n_steps
        epoch, max_steps = p.epoch, cfg.max_steps
        self._start_epoch_steps(iterator)
        stop = self._stop
        has_val = self.data.has_val()
        timed = has_val and schedule.clock is not None
        strategy = self.fit.strategy
        for batch_idx in range(start, stop):
            step = self.run_batch(batch_idx)
            if step is DATA_ENDED:
                break
            if step is EPOCH_SKIPPED:
                # As Lightning: the rest of the epoch is skipped and the epoch ends there (the next fit
                # epoch starts at its first batch), so its epoch-wise schedulers step now.
                p.skip_rest_of_epoch()
                step_schedulers(self.lr_scheduler_configs, "epoch", p.epoch + 1, metrics.callback,
                                self._scheduler_step, plateau=False)
                return True
            batch, output, stepped, last = step
            if (stepped or not automatic) and p.count_stepped_batch(log_every):
                self._log_step()
            # Set before on_train_batch_end: a checkpoint taken there records that a validation follows.
            time_up = timed and schedule.time_is_up(epoch, p.total_batches, strategy)  # every rank
            p.expect_validation(schedule.due_after(epoch, batch_idx, p.total_batches, last, has_val,
                                                   time_up=time_up))
            if end_hooks:
                outputs = _batch_outputs(output, automatic)
                for fn in end_hooks:
                    fn(outputs, batch, batch_idx)
            validated = p.validation_due and not last
            if validated:
                self._validate()
                metrics.start_stage("train", PER_STEP)
            if 0 <= max_steps <= p.global_step or stopping.out_of_time:
                return last
            stop_requested = stopping.agreed if self._multi_rank else stopping.requested
            if not last and stop_requested and self._min_reached():
                # As Lightning: the epoch ends here, validating first if this batch did not (and the epoch
                # does).
                p.expect_validation(not validated and schedule.due_after(
                    epoch, batch_idx, p.total_batches, False, has_val, stopping=True))
                return True
        return True

    def _none_batch(self, batch_idx: int, last: bool) -> tuple[Any, Any, bool, bool]:
        """A loader that yielded None (a collate_fn that drops a batch): as Lightning, no step, and
        ``on_train_batch_end`` gets no outputs. Across ranks the others would wait for this rank's
        gradients, so there it is an error."""
        if self._multi_rank:
            raise ValueError(f"the train_dataloader yielded None at batch {batch_idx} of epoch "
                             f"{self.progress.epoch} on global rank {self.fit.strategy.global_rank}: with "
                             f"several processes every rank must step together. Drop such batches in the "
                             f"dataset or sampler instead of returning None from collate_fn")
        rank_zero_warn("train_dataloader yielded None. If this was on purpose, ignore this warning: the "
                       "batch is skipped (no training step), as Lightning does")
        self.progress.take_batch(batch_idx, last)
        return None, None, False, last

    def _start_epoch_steps(self, iterator: Any) -> None:
        """What ``run_batch`` reads on every batch of this epoch, looked up once: the iterator (or the
        ranks' agreement on an iterable's batches), the hooks that run, the profiler's and the clock's
        blocks."""
        data = self.data
        self._iterator = iterator
        self._agreed = data.stream = agreed_batches(iterator, self.fit.strategy.reduce_boolean_decision,
                                                    data.train_loader) if self.agreed else None
        self._num_batches = data.num_training_batches
        self._stop = data.num_training_batches if data.num_training_batches is not None else 2**62
        self._accumulate = self.config.accumulate_grad_batches
        self._train_step = self.optimization.run
        self._start_hooks = self.fit.hooks.batch_plan("on_train_batch_start")
        self._beat = heartbeat.beat if self._multi_rank else None
        self._schedulers = bool(self.lr_scheduler_configs)
        self._transfer = self.fit.transfer_batch
        phase = self.fit.profiler.phase
        self._fetch_phase, self._data_clock = phase("get batch"), self.goodput.phase("data")
        self._transfer_phase, self._batch_phase = phase("batch to device"), phase("training batch")
        self.fit.metrics.defaults = PER_STEP

    def run_batch(self, batch_idx: int) -> tuple[Any, Any, bool, bool] | str:
        """One training batch, its phases in order: fetch, transfer, ``on_train_batch_start``, then the
        training step (the executor's ``train_step``, or manual optimisation's ``run``: forward, zero_grad,
        backward, clipping, the optimizer step, in Lightning's order), then the step-wise schedulers.
        Returns ``(batch, output, stepped, last)``; ``DATA_ENDED`` when some rank's stream ended,
        ``EPOCH_SKIPPED`` when ``on_train_batch_start`` returned -1."""
        p = self.progress
        with self._fetch_phase, self._data_clock:
            if self._agreed is None:
                batch = next(self._iterator)
                last = batch_idx + 1 == self._num_batches
            else:
                batch, last = self._agreed.take(batch_idx + 1 < self._stop)
        if batch is NO_BATCH:  # every rank learnt together that some stream has ended
            if batch_idx == 0:  # as Lightning: the epoch ends without a step, and the fit goes on
                rank_zero_warn(f"the training DataLoader yielded no batch in epoch {p.epoch} on at least "
                               f"one data-parallel rank: the epoch ends without a step (an iterable dataset "
                               f"yields nothing this epoch)")
            return DATA_ENDED
        if batch is None:
            return self._none_batch(batch_idx, last)
        with self._transfer_phase:
            batch = self._transfer(batch)
        self.fit.metrics.batch = batch  # its size is read only if a value is logged per epoch
        p.take_batch(batch_idx, last)
        end_of_window = (batch_idx + 1) % self._accumulate == 0 or last
        if self._beat is not None:
            self._beat(p.global_step, "training_step")
        if self._start_hooks and any([fn(batch, batch_idx) == -1 for fn in self._start_hooks]):
            return EPOCH_SKIPPED  # the rest of the epoch is skipped
        with self._batch_phase:
            output, stepped = self._train_step(batch, batch_idx, p.epoch, end_of_window)
        if stepped:
            p.count_optimizer_step()
            if self._schedulers:
                self._after_optimizer_step(last)
        return batch, output, stepped, last

    def _log_step(self) -> None:
        with self.fit.profiler.phase("logging step"):
            self._logging_step()
        self.goodput.mark(self.progress.global_step)

    def _logging_step(self) -> None:
        """Every ``log_every_n_steps``: per-step values to the loggers, then the losses' non-finite check, the
        time limit and a stop request (a callback's ``on_log`` may make one) agreed in the check's one gather.
        Every rank gets here at the same step, so the collectives inside stay matched. The parameters are
        checked before each checkpoint and at the end, not here: one made non-finite by a step makes the
        next loss non-finite."""
        s, metrics = self.stopping, self.fit.metrics
        values = metrics.pop_step_values(self.fit.strategy.dp_group)
        publish(metrics, self.fit.hooks, values, self.progress.global_step)
        stop, time_up = self.guard.check((s.requested, self._time_up()), parameters=False)
        if time_up:  # max_time: every rank stops here; the fit-end checkpoint lets a resubmitted job continue
            s.time_up()
        if self._multi_rank:
            s.agree(stop or time_up)

    def _after_optimizer_step(self, last_batch: bool) -> None:
        p = self.progress
        configs, metrics = self.lr_scheduler_configs, self.fit.metrics.callback
        step_schedulers(configs, "step", p.global_step, metrics, self._scheduler_step)
        if last_batch:  # Lightning's order: epoch schedulers after the epoch's last update
            step_schedulers(configs, "epoch", p.epoch + 1, metrics, self._scheduler_step, plateau=False)


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
