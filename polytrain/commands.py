"""What ``polytrain`` runs once its command line is parsed (``cli.py``): a stage's config and checkpoint
checked in the launching process, before any worker or process group starts (a typo costs seconds, not
a cluster allocation), then the workers; ``polytrain checkpoint`` and ``polytrain plan``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.multiprocessing import ProcessRaisedException

from polytrain.checkpoint.consolidate import consolidate
from polytrain.checkpoint.hugging_face import export_pretrained
from polytrain.checkpoint.layout import newest_resumable
from polytrain.core.errors import CheckpointError, ConfigError, StageInterrupted
from polytrain.core.rng import seed_all
from polytrain.core.worker_failure import (
    config_error_said,
    failure_report,
    quiet_agent_logs,
    root_cause,
    spawned_failure_report,
    spawned_root_cause,
)
from polytrain.plan_cli import run_plan
from polytrain.strategies.launcher import launch_elastic, launch_spawn, plan_launch
from polytrain.trainer.configuration.config import TrainerConfig, elastic_warning, instantiate, load_config
from polytrain.trainer.persistence.run_directory import check_run_dir_for_launch, checkpoint_for_launch
from polytrain.trainer.trainer import Trainer


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[polytrain rank {rank}] %(levelname)s %(message)s", force=True)


def run_worker(config: dict[str, Any], command: str, ckpt: str | None) -> Any:
    """What each worker process runs: build the module and the trainer, then call the stage."""
    _setup_logging(int(os.environ.get("RANK", "0")))
    config_dir = config.get("config_dir")
    if config["trainer"]["seed"] is not None:
        # Same seed on every rank while the module is built: replicas start identical.
        seed_all(config["trainer"]["seed"])
    module = instantiate(config["module"], "module", config_dir)
    datamodule = instantiate(config["data"], "data", config_dir) if config.get("data") else None
    trainer = Trainer.from_config(config)
    try:
        if command == "fit":
            result = trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        else:
            result = getattr(trainer, command)(module, datamodule=datamodule, ckpt_path=ckpt)
        if trainer.is_logging_rank and command == "fit":  # validate and test print their table themselves
            _print_metrics(trainer)
            print(f"run directory: {trainer.log_dir}", flush=True)
        return result
    finally:
        if trainer.strategy is not None:
            trainer.strategy.teardown()


def _print_metrics(trainer: Any) -> None:
    # Four significant digits: a loss of 0.000194 is printed as such, not as 0.0000.
    shown = {k: float(v) for k, v in trainer.callback_metrics.items()
             if k.split("/")[0].startswith(("val", "train"))}
    if shown:
        print("final metrics: " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())), flush=True)


def _elastic_entry(config: dict[str, Any], command: str, ckpt: str | None) -> None:
    # @record writes this worker's traceback where the agent finds it, so the failure summary
    # names the rank and shows the real error.
    record(run_worker)(config, command, ckpt)


def _checkpoint(args: argparse.Namespace) -> int:
    """``polytrain checkpoint consolidate|export``: the exit code (an export's refusal: 2 and one line)."""
    if args.action == "consolidate":
        consolidate(args.source, args.output)  # a refused checkpoint raises, as it always has
        print(f"wrote {args.output}")
        return 0
    try:
        report = export_pretrained(args.source, args.output, int(args.max_shard_size * 1e9), args.model)
    except (CheckpointError, ConfigError) as err:
        print(f"polytrain: checkpoint {args.action}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    tied = f"; tied, stored once: {', '.join(report.tied_left_out)}" if report.tied_left_out else ""
    print(f"wrote {args.output}: {report.architecture} ({report.path or 'the module itself'} in the module), "
          f"{report.tensors} tensors, {report.total_bytes / 1e6:.1f} MB in {len(report.files)} file(s){tied}")
    return 0


def run(args: argparse.Namespace) -> int:
    """A parsed command line, run: ``checkpoint``, ``plan``, or a stage (its config and checkpoint checked
    here, then the workers started). The exit code."""
    if args.command == "checkpoint":
        return _checkpoint(args)
    if args.command == "plan":
        try:
            return run_plan(args)
        except ConfigError as err:
            print(f"polytrain: plan: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    try:
        config = load_config(args.config, args.overrides)
        trainer_cfg = TrainerConfig(**config["trainer"])
        plan = plan_launch(trainer_cfg)
    except ConfigError as err:
        # One line: YAML parser errors carry multi-line source excerpts.
        print(f"polytrain: config error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    warning = elastic_warning(trainer_cfg)
    if warning is not None:
        print(f"polytrain: warning: {warning}", file=sys.stderr)
    _setup_logging(int(os.environ.get("RANK", "0")))  # the check below says which checkpoint it took
    try:
        if args.command != "predict":  # the other stages write their logs and checkpoints under run_dir
            check_run_dir_for_launch(trainer_cfg)
        ckpt = checkpoint_for_launch(args.command, args.ckpt, trainer_cfg)
    except ConfigError as err:
        print(f"polytrain {args.command}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    try:
        return _start(args, config, trainer_cfg, plan, ckpt)
    # Ctrl-C here or while spawned workers ran (they had it too); StageInterrupted: a Trainer here saw it
    except (KeyboardInterrupt, StageInterrupted):
        return _stopped(args, trainer_cfg, signal.SIGINT)
    except SignalException as err:  # the elastic agent's: it has ended its workers with the same signal
        return _stopped(args, trainer_cfg, err.sigval)


def _start(args: argparse.Namespace, config: dict[str, Any], trainer_cfg: TrainerConfig, plan: Any,
           ckpt: str | None) -> int:
    if plan.method == "here":
        # A scheduler's SIGTERM ends the job as Ctrl-C does (the elastic agent does the same for its workers).
        signal.signal(signal.SIGTERM, _raise_stopped)
        run_worker(config, args.command, ckpt)
        return 0
    if plan.method in ("spawn", "fork"):
        quiet_agent_logs()  # torch's line for each worker it stops after the first failed
        try:
            launch_spawn(plan, run_worker, (config, args.command, ckpt))
        except ProcessRaisedException as err:  # the first failing worker's traceback; the others were stopped
            return _worker_failed(args.command, spawned_root_cause(err), spawned_failure_report(err))
        return 0
    if trainer_cfg.max_restarts == 0:
        quiet_agent_logs()  # the report below shows the failing rank's traceback once
    try:
        launch_elastic(plan, _elastic_entry, (config, args.command, ckpt), trainer_cfg.max_restarts)
    except ChildFailedError as err:
        return _worker_failed(args.command, root_cause(err), failure_report(err))
    return 0


def _worker_failed(command: str, cause: str, report: str) -> int:
    """A worker's failure: its traceback, then the root cause in one line, last, where it is read first. A
    config error a worker found (one the launcher cannot see: a class named in the config, looked for in
    the module) is said as the launcher says its own, in one line with exit code 2."""
    said = config_error_said(cause)
    if said is not None:
        print(f"polytrain {command}: {said}", file=sys.stderr)
        return 2
    print(report, file=sys.stderr)
    print(f"polytrain: {command} failed on {cause}", file=sys.stderr)
    return 1


def _raise_stopped(signum: int, frame: Any) -> None:
    raise SignalException(f"received {signal.Signals(signum).name}", signal.Signals(signum))


def _stopped(args: argparse.Namespace, trainer_cfg: TrainerConfig, signum: int) -> int:
    """A job stopped by SIGINT (Ctrl-C) or SIGTERM (a scheduler): no traceback, the newest complete checkpoint
    and, for a fit, the command that continues it; the shell's code for the signal (130, 143)."""
    name = signal.Signals(signum).name
    newest = newest_resumable(trainer_cfg.run_dir, trainer_cfg.version)
    saved = f"the newest complete checkpoint is {newest[1]}" if newest else "no checkpoint had been written"
    print(f"polytrain: {args.command} stopped by {name}; its processes have ended and {saved}",
          file=sys.stderr)
    if args.command == "fit" and newest is not None:
        print(f"polytrain: to continue it: {_continue_command(args)}", file=sys.stderr)
    return 128 + int(signum)


def _continue_command(args: argparse.Namespace) -> str:
    """This fit's command line with ``trainer.resume=last`` in place of any resume or ``--ckpt`` it had."""
    kept = [item for item in args.overrides if not item.startswith("trainer.resume=")]
    # The console script as it was typed (.venv/bin/polytrain), else the interpreter running the module.
    program = [sys.argv[0]]
    if os.path.basename(sys.argv[0]) != "polytrain":
        program = [sys.executable, "-m", "polytrain"]
    return shlex.join([*program, "fit", "-c", args.config, *kept, "trainer.resume=last"])
