"""``ModelCheckpoint``: periodic, top-k and ``last`` checkpoints, saved by every rank together."""

# No `from __future__ import annotations`: the constructor's annotations stay types, which tools that read
# a signature to build a command line (jsonargparse, LightningCLI) parse values with.
import logging
import math
import os
import re
import shutil
from datetime import timedelta
from typing import Any, Literal

import torch
import yaml

from polytrain.callbacks.base import Callback
from polytrain.callbacks.on_exception_checkpoint import save_after_exception
from polytrain.callbacks.time_trigger import TimeTrigger
from polytrain.checkpoint.hugging_face import export_pretrained, find_pretrained
from polytrain.checkpoint.layout import checkpoint_dir, write_latest_pointer
from polytrain.core.errors import CheckpointError, ConfigError
from polytrain.core.files import temporary_sibling
from polytrain.core.rank_zero import rank_zero_warn
from polytrain.core.states import TrainerFn

log = logging.getLogger("polytrain")


class ModelCheckpoint(Callback):
    """Save every ``every_n_train_steps`` optimizer steps and/or every ``every_n_epochs`` epochs.

    A step checkpoint at a step after which a validation runs (``val_check_interval``) is written after
    that validation, as Lightning does: the file holds its metrics (``monitor`` ranks by them) and
    resumes with the next batch, the validation not run again.

    With ``monitor``, keep the ``save_top_k`` best by that (rank-reduced) metric; without it,
    keep the ``save_top_k`` newest (-1 keeps all). ``save_last`` (``True`` or ``"link"``; Lightning's
    default None is off) also keeps the newest state as ``last.ckpt`` (a hard link to a kept file, or the
    file itself when it did not make the top k); in the run's own ``checkpoints/`` (no ``dirpath``
    given) a ``latest`` pointer names the newest for ``resume: last``. Every decision is taken
    identically on every rank, and agreed on before anyone acts, so the collective inside
    ``save_checkpoint`` is always matched.

    ``train_time_interval`` (a ``timedelta``): also save after an optimizer step once that much time
    passed since the last save, by global rank 0's clock (``time_trigger``: checked at a few agreed
    steps per interval, not every step). ``async_save``: training waits only while the state is copied
    to CPU (on CPU, the copy of the parameters and optimizer state runs in the background too, during
    the next forward and backward; the next optimizer update waits for it, so a tensor the module changes
    in place outside an optimizer step right after a save would reach the file: save synchronously
    then); the write, then the ``latest`` pointer, ``last.ckpt`` and pruning happen in the background
    once the file is complete (``polytrain.checkpoint.async_writer``); the next save and the end of fit
    wait for it, and a failed write raises there on every rank.

    ``save_hf`` (polytrain's): when the fit ends, the best checkpoint (the newest without ``monitor``) is
    also written as a Hugging Face directory beside it, ``<name>.hf`` (``polytrain checkpoint export
    --format hf``, by global rank 0), for a module holding a transformers ``PreTrainedModel``: the first
    (``True``) or the one at the path given (``save_hf="backbone"``); ``hf_model_path`` names it.
    """

    watches_metrics = True

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1  # the first `-v<n>` a name already taken gets

    def __init__(self, dirpath: str | None = None, filename: str | None = None,
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1,
                 save_last: bool | Literal["link"] | None = None,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = 1,
                 save_on_fit_end: bool = True, train_time_interval: timedelta | None = None,
                 async_save: bool = False, save_on_exception: bool = False,
                 save_on_train_epoch_end: bool | None = None, verbose: bool = False,
                 save_weights_only: bool = False, auto_insert_metric_name: bool = True,
                 enable_version_counter: bool = True, save_hf: bool | str = False) -> None:
        if save_last not in (None, True, False, "link"):
            raise ConfigError(f"ModelCheckpoint save_last={save_last!r}: give True, False, None or 'link' "
                              f"(last.ckpt beside the newest checkpoint, as a link to it)")
        if mode not in ("min", "max"):
            raise ConfigError(f"ModelCheckpoint `mode` can be min, max but got {mode}")
        if save_top_k < -1:
            raise ConfigError(f"ModelCheckpoint: invalid value for save_top_k={save_top_k}. Must be >= -1 "
                              f"(-1 keeps all, 0 only last, k > 0 the best k)")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 0:
                raise ConfigError(f"ModelCheckpoint: invalid value for {name}={value}. Must be >= 0 "
                                  f"(0 or None: never by this trigger)")
        if train_time_interval is not None and every_n_train_steps:
            raise ConfigError(f"ModelCheckpoint every_n_train_steps={every_n_train_steps} and "
                              f"train_time_interval={train_time_interval} should be mutually exclusive "
                              "(as in Lightning); pass one of them")
        if dirpath is not None:
            dirpath = os.path.realpath(os.path.expanduser(os.fspath(dirpath)))  # `~/ckpts`, as Lightning
        self.dirpath = dirpath
        self._dirpath_given = dirpath is not None
        self._written: set[str] = set()  # files this callback wrote (in this process or before a resume)
        self.filename = filename
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        self.save_weights_only = save_weights_only
        self._unlogged_warned: set[str] = set()  # filename fields already warned about (written as 0)
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.save_on_fit_end = save_on_fit_end
        self.save_on_exception = save_on_exception
        # None: at a training epoch's end unless validation runs within epochs or skips some (then after
        # the validation that ends the epoch, so the epoch's checkpoint holds its validation metrics)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.verbose = verbose
        self.train_time_interval = train_time_interval
        self._timer = TimeTrigger(train_time_interval) if train_time_interval is not None else None
        self.async_save = async_save
        self.save_hf = save_hf
        self.hf_model_path = ""  # the Hugging Face directory save_hf wrote at the end of the last fit
        self._unannounced = False  # an async save the loggers have not been told about (it is still writing)
        self._before_async: tuple[Any, ...] | None = None  # the bookkeeping to return to if that save fails
        self.kept: list[tuple[float, str]] = []  # (score or -step, path), best first
        self.best_model_path = ""
        # Tensors, as Lightning's (``best_model_score.item()``): the best kept file's score, and the monitored
        # value at the newest save
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._step_at_last_batch = 0
        self._after_validation_step: int | None = None  # a step save waiting for the validation at its step
        self._saved_in_fit = False  # whether any trigger saved in the present fit

    @property
    def state_key(self) -> str:
        # Two ModelCheckpoints with other settings keep their own state in a checkpoint (Lightning's key).
        return self._generate_state_key(monitor=self.monitor, mode=self.mode,
                                        every_n_train_steps=self.every_n_train_steps or 0,
                                        every_n_epochs=self.every_n_epochs or 0,
                                        train_time_interval=self.train_time_interval)

    @property
    def writes_into_run_directory(self) -> bool:
        """No ``dirpath`` was given: the checkpoints go to ``<log_dir>/checkpoints``."""
        return not self._dirpath_given

    # ------------------------------------------------------------------ Lightning's views of `kept`
    # ``kept`` is the one record; these are Lightning's names for it. ``best_k_models`` can be set (Lightning
    # code restoring a callback's state does); ``kth_best_model_path`` and ``kth_value`` follow from it and
    # ``save_top_k``, so setting them accepts only what they already are.
    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """Kept file -> its monitored score (without a monitor: minus the step it was saved at)."""
        return {path: _score_tensor(-key if self.mode == "max" else key) for key, path in self.kept}

    @best_k_models.setter
    def best_k_models(self, models: dict[str, Any]) -> None:
        sign = 1.0 if self.mode == "min" else -1.0  # kept best first: the lowest key first
        keys = [(sign * float(score), path) for path, score in models.items()]
        self.kept = sorted(keys, key=lambda kp: kp[0])

    @property
    def kth_best_model_path(self) -> str:
        """The kept file that goes first when a better one comes (the worst of the top k)."""
        return self.kept[-1][1] if self.kept else ""

    @kth_best_model_path.setter
    def kth_best_model_path(self, path: str) -> None:
        if path != self.kth_best_model_path:
            raise ValueError(f"ModelCheckpoint.kth_best_model_path={path!r}: it is the worst of "
                             f"best_k_models ({self.kth_best_model_path!r} now); set best_k_models to "
                             f"change it")

    @property
    def kth_value(self) -> torch.Tensor:
        """The score a new file must beat to be kept: the worst kept one's once ``save_top_k`` files are kept
        (with ``save_top_k=-1``, always), infinite before."""
        if not self.kept or (self.save_top_k != -1 and len(self.kept) < self.save_top_k):
            return _score_tensor(math.inf if self.mode == "min" else -math.inf)
        key = self.kept[-1][0]
        return _score_tensor(-key if self.mode == "max" else key)

    @kth_value.setter
    def kth_value(self, value: Any) -> None:
        if float(value) != float(self.kth_value):
            raise ValueError(f"ModelCheckpoint.kth_value={float(value)}: it is the score of the worst of "
                             f"best_k_models ({float(self.kth_value)} now); set best_k_models to change it")

    def to_yaml(self, filepath: str | None = None) -> None:
        """Write ``best_k_models`` to ``filepath`` (default ``<dirpath>/best_k_models.yaml``)."""
        if filepath is None:
            if self.dirpath is None:
                raise ValueError("ModelCheckpoint.to_yaml() needs a filepath until the callback has a "
                                 "dirpath (set when a stage starts)")
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as out:
            yaml.safe_dump({path: float(score) for path, score in self.best_k_models.items()}, out)

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self.__dict__["_max_steps_save"] = self.save_on_fit_end and trainer.config.max_steps >= 0
        if not self._dirpath_given:  # the run's own directory (trainer.log_dir: <run_dir>/version_<n>)
            self.dirpath = checkpoint_dir(trainer.log_dir)
        self._forget_foreign_files()

    def _forget_foreign_files(self) -> None:
        """State restored from a checkpoint written elsewhere (another run_dir) lists that run's
        files: they are not ours to prune."""
        if self.dirpath is None:
            return
        here = os.path.abspath(self.dirpath)
        self.kept = [(k, p) for k, p in self.kept if os.path.dirname(os.path.abspath(p)) == here]

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if self.save_hf:  # a module holding no such Hugging Face model is refused now, not at the end
            find_pretrained(module, self.save_hf if isinstance(self.save_hf, str) else None)
        # After the resume (if any): the state at this step is the file just loaded, so saving it again
        # (at fit end, say) would rewrite that step's name with another position or other RNG states.
        self._step_at_last_batch = trainer.global_step
        self._last_saved_step = trainer.global_step if trainer.global_step > 0 else -1
        self._saved_in_fit = False
        if self._timer is not None:
            self._timer.start(trainer.global_step)

    # ------------------------------------------------------------------ triggers
    @property
    def idle_batch_hooks(self) -> tuple[str, ...]:
        """Without step-based saving the batch hook has nothing to do; the loop skips it
        (it asks each epoch)."""
        by_step = self.every_n_train_steps or self._timer is not None
        return () if by_step or self.__dict__.get("_max_steps_save") else ("on_train_batch_end",)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Only right after an optimizer step: under gradient accumulation the other micro-batches end
        # with a pending gradient that no checkpoint holds, and they repeat the step number.
        stepped = trainer.global_step != self._step_at_last_batch
        self._step_at_last_batch = trainer.global_step
        n, step = self.every_n_train_steps, trainer.global_step
        due = bool(n) and stepped and step % n == 0
        # Every rank reaches the timer at the same steps (it communicates only at agreed check steps).
        due = (stepped and self._timer is not None and self._timer.due(step, trainer.strategy)) or due
        # The step max_steps ends the fit at: saved now, as Lightning's epoch-end save at that step comes
        # before on_train_end (which may read last_model_path); a validation at this step comes first.
        due = due or (self.save_on_fit_end and stepped and 0 <= trainer.config.max_steps <= step)
        if due and step != self._last_saved_step:
            if _progress(trainer, "validation_due", False):
                self._after_validation_step = trainer.global_step  # saved in on_validation_end
            else:
                self._save(trainer)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if self._after_validation_step is not None and self._after_validation_step == trainer.global_step:
            self._after_validation_step = None
            self._save(trainer)
        elif (self._epoch_due(trainer) and not self._saves_on_train_epoch_end(trainer)
              and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
              and trainer.global_step != self._last_saved_step):
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if (self._epoch_due(trainer) and self._saves_on_train_epoch_end(trainer)
                and _progress(trainer, "at_epoch_end", True)):
            self._save(trainer)

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        """``save_on_exception``: the state when the fit raised, under the callback's file name."""
        if (not self.save_on_exception or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or getattr(trainer, "fast_dev_run", False) or trainer.global_step == self._last_saved_step
                or self.dirpath is None):
            return
        ext = "" if not trainer.strategy.replicated else self.FILE_EXTENSION
        path = self._unclaimed(trainer, self._format_name(trainer), ext)
        if save_after_exception(trainer, path, exception):
            self._written.add(path)
            self.last_model_path = path

    def _epoch_due(self, trainer: Any) -> bool:
        n = self.every_n_epochs
        return bool(n) and (trainer.current_epoch + 1) % n == 0

    def _saves_on_train_epoch_end(self, trainer: Any) -> bool:
        """Whether an epoch's checkpoint is written when the training epoch ends (else after the epoch's
        validations, each of them when several run in an epoch), by Lightning's rule."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.config.check_val_every_n_epoch != 1:
            return False  # epochs without validation: save after the ones that validate
        if all(n == 0 for n in trainer.num_val_batches):
            return True  # no validation at all
        return trainer.config.val_check_interval in (None, 1.0)  # unset: once, at the epoch's end

    def on_train_end(self, trainer: Any, module: Any) -> None:
        # As Lightning's save at the end of training: before on_train_end's other hooks and on_fit_end.
        # Only a fit stopped inside an epoch (max_steps, max_time, a stop request) saves here, so that
        # `resume: last` continues from exactly there; one that ran its epochs out keeps what its epoch
        # triggers wrote (every_n_epochs=2 over 5 epochs: epochs 1 and 3, as Lightning).
        stopped_inside = trainer.batch_in_epoch > 0
        if self.save_on_fit_end and stopped_inside and trainer.global_step != self._last_saved_step:
            self._save(trainer)
        elif (self.save_last and not self._saved_in_fit
              and trainer.global_step != self._last_saved_step):
            # As Lightning: save_last asks for a last.ckpt even where no trigger fired in the whole fit
            self._save(trainer, last_only=True)

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self._settle(trainer)
        if self.save_hf:
            self._export_hf(trainer)

    def _export_hf(self, trainer: Any) -> None:
        """The best (or newest) checkpoint as a Hugging Face directory beside it, written by global rank 0
        from the file on disk; a failure raises on every rank. An existing directory is never written into."""
        source = self.best_model_path or self.last_model_path
        if not source:
            return
        base = source.rstrip(os.sep) if os.path.isdir(source) else os.path.splitext(source)[0]
        target = f"{base}.hf"
        error = None
        if trainer.is_global_zero:
            try:
                if os.path.exists(target):
                    log.info("ModelCheckpoint(save_hf=True): %s exists already; not written again", target)
                else:
                    export_pretrained(source, target,
                                      model=self.save_hf if isinstance(self.save_hf, str) else None)
            except (CheckpointError, ConfigError, OSError) as err:
                error = f"ModelCheckpoint(save_hf=True) could not write {target}: {err}"
        failures = [e for e in trainer.strategy.all_gather_object(error) if e is not None]
        if failures:
            raise CheckpointError(failures[0])
        self.hf_model_path = target

    # ------------------------------------------------------------------ saving
    def _format_name(self, trainer: Any) -> str:
        fields: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        fields.update({k.replace("/", "_"): v for k, v in list(fields.items())})
        fields.update(epoch=trainer.current_epoch, step=trainer.global_step)
        return self.format_name(fields)

    def format_name(self, metrics: dict[str, Any], filename: str | None = None, prefix: str = "") -> str:
        """The file name (without directory or extension) for ``metrics``, as Lightning forms it: the
        default ``{epoch}-{step}``; each ``{name}`` becomes ``name=<value>`` unless
        ``auto_insert_metric_name=False``; names may hold ``/`` or ``.``; a name nothing logged is written
        as 0 (Lightning's rule), with a warning the first time."""
        template = filename if filename is not None else self.filename
        template = original = template or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        values = dict(metrics)
        # longest first, so `{val}` does not rewrite the start of `{val_loss}`
        for group in sorted(set(re.findall(r"(\{.*?)[:}]", template)), key=len, reverse=True):
            name = group[1:]
            shown = name.replace("/", "_") + self.CHECKPOINT_EQUALS_CHAR
            inserted = shown if self.auto_insert_metric_name else ""
            template = template.replace(group, inserted + "{0[" + name + "]")
            if name not in values:
                values[name] = 0
                if name not in self._unlogged_warned:
                    self._unlogged_warned.add(name)
                    logged = ", ".join(sorted(metrics)) or "nothing"
                    rank_zero_warn(f"ModelCheckpoint filename {original!r} names {name!r}, which nothing "
                                   f"logged; it is written as 0 (logged: {logged})")
        try:
            name = template.format(values)
        except (KeyError, ValueError, IndexError) as err:
            raise ValueError(f"ModelCheckpoint filename {template!r} cannot be formatted: {err}; "
                             f"available: {', '.join(sorted(values))}") from None
        return self.CHECKPOINT_JOIN_CHAR.join([prefix, name]) if prefix else name

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None,
                               ver: int | None = None, prefix: str = "") -> str:
        """Lightning's method: the path a checkpoint with ``metrics`` gets in ``dirpath`` (``ver``: the
        ``-v<ver>`` a name already taken gets)."""
        name = self.format_name(metrics, filename, prefix)
        if ver is not None:
            name += f"{self.CHECKPOINT_JOIN_CHAR}v{ver}"
        name += self.FILE_EXTENSION
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _score(self, trainer: Any) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor in ("epoch", "step") and self.monitor not in trainer.callback_metrics:
            return float(trainer.current_epoch if self.monitor == "epoch" else trainer.global_step)
        if self.monitor not in trainer.callback_metrics and not self._validated(trainer):
            return None  # nothing to rank by yet (no validation so far): saved as `last` only
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(f"ModelCheckpoint monitors '{self.monitor}' but it was not logged; logged: "
                           f"{', '.join(sorted(trainer.callback_metrics)) or '(nothing)'}")
        score = float(trainer.callback_metrics[self.monitor])
        if math.isnan(score):  # as Lightning: a NaN ranks below every number
            score = math.inf if self.mode == "min" else -math.inf
        return score

    @staticmethod
    def _validated(trainer: Any) -> bool:
        return any(k.startswith(("val", "valid")) for k in trainer.callback_metrics)

    def _is_better(self, score: float, worst: float) -> bool:
        return score < worst if self.mode == "min" else score > worst

    def _save(self, trainer: Any, last_only: bool = False) -> None:
        """A save where a trigger fired: a kept file when it ranks, else ``last`` (with ``save_last``);
        ``last_only``: ``last`` alone."""
        if getattr(trainer, "fast_dev_run", False):
            # a quick check of every loop writes nothing, as Lightning (even this callback given explicitly)
            return
        self._saved_in_fit = True
        score = self._score(trainer)
        self.current_score = _score_tensor(score)
        unranked = self.monitor is not None and score is None
        keep = not last_only and self.save_top_k != 0 and not unranked and (
            self.save_top_k == -1 or len(self.kept) < self.save_top_k or self.monitor is None
            # `kept` holds negated scores in max mode (best first when sorted ascending).
            or self._is_better(score, -self.kept[-1][0] if self.mode == "max" else self.kept[-1][0])
        )
        if self.monitor is not None and not last_only:
            # A monitored value logged without sync_dist differs across ranks, and so may this answer:
            # agree. Without a monitor it follows from the options and `kept` (the same bookkeeping runs
            # on every rank, and a resume loads the same list everywhere), so the ranks already agree.
            keep = trainer.strategy.reduce_boolean_decision(keep)
        if not keep and not self.save_last:
            return
        ext = "" if not trainer.strategy.replicated else self.FILE_EXTENSION
        if keep:
            # the kept file this save pushes out of a full top k may have the new file's name
            full = 0 < self.save_top_k <= len(self.kept)
            replacing = (self.kept[-1][1],) if full else ()
            if self._last_saved_step == trainer.global_step:  # a second save of this step (another
                replacing += (self.last_model_path,)  # trigger at the same step): the same state again
            path = self._unclaimed(trainer, self._format_name(trainer), ext, replacing=replacing)
        else:  # the newest state as `last`: in place of the last one, or of the link to a kept file
            path = self._unclaimed(trainer, self.CHECKPOINT_NAME_LAST, ext,
                                   replacing=(self.last_model_path, self._last_link))
        # Bookkeeping runs on every rank (so the next decision is the same everywhere) and before
        # the payload is built (so a resumed run knows this file and can prune it later).
        self._settle(trainer, before=path)  # the previous async save is on disk (or raised on every rank)
        previous = self._bookkeeping()
        doomed = self._record(trainer, path, score) if keep else []
        try:
            trainer.save_checkpoint(path, weights_only=self.save_weights_only, async_save=self.async_save)
        except BaseException:
            self._restore(previous)  # nothing was written: forget it, delete nothing
            raise
        self._before_async = previous if self.async_save else None
        self._last_saved_step = trainer.global_step
        self.last_model_path = path
        if self.verbose and trainer.is_global_zero:
            reached = f"{self.monitor!r} reached {score:.5g} (best {self.best_model_score:.5g}), " if (
                keep and score is not None) else ""
            log.info("Epoch %d, global step %d: %ssaving model to %r", trainer.current_epoch,
                     trainer.global_step, reached, path)
        self._written.add(path)
        if self._timer is not None:
            self._timer.restart()
        if trainer.strategy.is_global_zero:
            # Pointer, link and pruning only once the file is complete: now, or when the async write ends.
            trainer.strategy.checkpoint_io.after_write(lambda: self._update_disk(trainer, path, doomed))
        if self.async_save:
            self._unannounced = True
            return
        trainer.strategy.barrier("checkpoint-retention")
        self._announce(trainer)

    def _settle(self, trainer: Any, before: str | None = None) -> None:
        """Every rank: wait for an async save still writing, then tell the loggers about it."""
        if self._unannounced:
            self._unannounced = False
            try:
                trainer.strategy.checkpoint_io.finish(before)
            except BaseException:
                # The write failed (every rank raises here): the file is not kept, and the ones it would
                # have pruned were not deleted (after-write actions are dropped on failure).
                if self._before_async is not None:
                    self._restore(self._before_async)
                raise
            self._announce(trainer)

    def _bookkeeping(self) -> tuple[Any, ...]:
        return list(self.kept), self.best_model_path, self.best_model_score, self.last_model_path

    def _restore(self, saved: tuple[Any, ...]) -> None:
        kept, self.best_model_path, self.best_model_score, self.last_model_path = saved
        self.kept = list(kept)

    def _announce(self, trainer: Any) -> None:
        if trainer.is_logging_rank:
            # loggers that upload checkpoints (log_model=...): the file is complete
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _unclaimed(self, trainer: Any, stem: str, ext: str, replacing: tuple[str, ...] = ()) -> str:
        """``<dirpath>/<stem><ext>``, or, where that name is taken, ``<stem>-v1<ext>``, ``-v2``, ...
        (Lightning's version counter, from ``STARTING_VERSION``). Taken: a file this callback keeps (as with
        ``save_top_k=-1`` and a fixed ``filename``), except one of ``replacing``, the files this save takes
        the place of; and, in a directory the user named, any file this callback did not write (another
        run's). In the run's own directory a file it does not keep is this run's own, left by an attempt
        that a resume repeats: written over. ``enable_version_counter=False``: the name as formatted,
        whatever is there (Lightning's option for a fixed name). Global rank 0 looks; every rank gets its
        answer."""
        path = os.path.join(self.dirpath, stem + ext)
        if not self.enable_version_counter:
            return path
        kept = {p for _, p in self.kept} - set(replacing)
        ours = self._written | {self.last_model_path, *replacing}

        def taken(candidate: str) -> bool:
            if candidate in kept:
                return True
            return self._dirpath_given and candidate not in ours and os.path.exists(candidate)

        if trainer.strategy.is_global_zero:
            n = self.STARTING_VERSION
            while taken(path):
                path = os.path.join(self.dirpath, f"{stem}{self.CHECKPOINT_JOIN_CHAR}v{n}{ext}")
                n += 1
        return trainer.strategy.broadcast(path)

    def _record(self, trainer: Any, path: str, score: float | None) -> list[str]:
        """Add ``path`` to the kept list; return the paths that fall out of the top k."""
        key = -float(trainer.global_step) if score is None else (-score if self.mode == "max" else score)
        self.kept = sorted([(k, p) for k, p in self.kept if p != path] + [(key, path)], key=lambda kp: kp[0])
        doomed: list[str] = []
        if self.save_top_k > 0:
            # The newest checkpoint always survives, even when it ranks below the top k.
            doomed = [p for _, p in self.kept[self.save_top_k:] if p != path]
            self.kept = [kp for kp in self.kept if kp[1] not in doomed]
        # without a monitor the newest file is the "best" (Lightning's meaning of ckpt_path="best")
        if self.kept:
            best_key, self.best_model_path = self.kept[0]
            if self.monitor is not None:
                self.best_model_score = _score_tensor(-best_key if self.mode == "max" else best_key)
        return doomed

    @property
    def _last_link(self) -> str:
        """Where ``last.ckpt`` goes (rank 0 only): as ``_unclaimed``, never over another run's file."""
        if self.__dict__.get("_last_link_path") is None:
            stem, ext = self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION
            path, n = os.path.join(self.dirpath, stem + ext), self.STARTING_VERSION
            # After a resume the directory's last.ckpt is this run's own.
            while (self._dirpath_given and self.enable_version_counter and not self.__dict__.get("_resumed")
                   and os.path.exists(path)):
                path = os.path.join(self.dirpath, f"{stem}{self.CHECKPOINT_JOIN_CHAR}v{n}{ext}")
                n += 1
            self.__dict__["_last_link_path"] = path
        return self.__dict__["_last_link_path"]

    def _update_disk(self, trainer: Any, path: str, doomed: list[str]) -> None:
        """Rank 0 only: pointer, ``last.ckpt`` link, pruning. No collectives in here. The ``latest`` pointer
        goes into the run's own checkpoint directory only: a ``dirpath`` the user named holds nothing but
        the checkpoints asked for (``resume: last`` ranks them by the step recorded inside)."""
        if not self._dirpath_given:
            write_latest_pointer(self.dirpath, path)
        if (self.save_last and trainer.strategy.replicated
                and not os.path.basename(path).startswith(self.CHECKPOINT_NAME_LAST)):
            last = self._last_link
            tmp = temporary_sibling(last)
            os.link(path, tmp)  # no second write: a hard link to the file just saved
            os.replace(tmp, last)
        for old in doomed:
            _remove(old)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [[k, p] for k, p in self.kept], "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "current_score": self.current_score, "monitor": self.monitor, "dirpath": self.dirpath,
                # Lightning's names for what ``kept`` holds, for Lightning code reading a checkpoint
                "best_k_models": self.best_k_models, "kth_best_model_path": self.kth_best_model_path,
                "kth_value": self.kth_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As Lightning's: the whole record where the checkpoint was written by a callback writing into
        this ``dirpath``; from another directory only ``best_model_path`` (with a warning), since the other
        files are not this callback's to rank or prune."""
        saved_dirpath = state.get("dirpath", self.dirpath)
        if self.dirpath is not None and saved_dirpath is not None and saved_dirpath != self.dirpath:
            rank_zero_warn(f"The dirpath has changed from {saved_dirpath!r} to {self.dirpath!r}, therefore "
                           f"`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and "
                           f"`best_k_models` won't be reloaded. Only `best_model_path` will be reloaded.")
        else:
            if "kept" in state:
                self.kept = [(float(k), p) for k, p in state["kept"]]
            else:  # a Lightning checkpoint's callback state
                self.best_k_models = state.get("best_k_models") or {}
            self.best_model_score = _score_tensor(state.get("best_model_score"))
            self.last_model_path = state.get("last_model_path") or ""
            self.current_score = _score_tensor(state.get("current_score"))
        self.best_model_path = state.get("best_model_path") or ""
        self.__dict__["_resumed"] = True
        self._forget_foreign_files()  # restored after setup: filter again


def _score_tensor(score: float | torch.Tensor | None) -> torch.Tensor | None:
    """A score as the 0-dim float tensor Lightning keeps (older files hold floats)."""
    return None if score is None else torch.as_tensor(score, dtype=torch.float32).detach().cpu()


def _progress(trainer: Any, name: str, default: Any) -> Any:
    """The fit loop's state (``trainer.fit_loop.progress``; a stand-in trainer may lack it)."""
    return getattr(getattr(getattr(trainer, "fit_loop", None), "progress", None), name, default)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("could not delete old checkpoint %s: %s", path, err)
