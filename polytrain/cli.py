"""``polytrain fit|validate|test|predict --config cfg.yaml key=value ...`` and ``polytrain checkpoint``.

The config is loaded and validated in the launching process, before any worker or process group
starts, so a typo costs a second, not a cluster allocation.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.multiprocessing import ProcessRaisedException

from polytrain.checkpoint.consolidate import consolidate
from polytrain.core.errors import ConfigError
from polytrain.core.rng import seed_all
from polytrain.plan_cli import add_parser as add_plan_parser
from polytrain.plan_cli import run_plan
from polytrain.strategies.launcher import launch_elastic, launch_spawn, plan_launch
from polytrain.trainer.config import TrainerConfig, elastic_warning, instantiate, load_config
from polytrain.trainer.run_directory import checkpoint_for_launch
from polytrain.trainer.trainer import Trainer

STAGES = ("fit", "validate", "test", "predict")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polytrain", description="One Trainer, many parallelisms.")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"{stage} a TrainModule described by a YAML config")
        p.add_argument("--config", "-c", required=True, help="YAML file with module:, data: (or datamodule:) and trainer:")
        p.add_argument("--ckpt", default=None, help="checkpoint: a path (a file or a sharded directory), 'last' "
                       "(the newest of the newest run), 'best' (the best a ModelCheckpoint recorded) or 'auto'")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_epochs=3")
    ck = sub.add_parser("checkpoint", help="checkpoint utilities")
    ck_sub = ck.add_subparsers(dest="action", required=True)
    cons = ck_sub.add_parser("consolidate", help="write a checkpoint's model weights as one plain state_dict file")
    cons.add_argument("source", help="a checkpoint file or sharded checkpoint directory")
    cons.add_argument("output", help="where to write the state_dict (torch.save format)")
    add_plan_parser(sub)
    return parser


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
        return result
    finally:
        if trainer.strategy is not None:
            trainer.strategy.teardown()


def _print_metrics(trainer: Any) -> None:
    # Four significant digits: a loss of 0.000194 is printed as such, not as 0.0000.
    shown = {k: float(v) for k, v in trainer.callback_metrics.items() if k.split("/")[0].startswith(("val", "train"))}
    if shown:
        print("final metrics: " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())), flush=True)


def _elastic_entry(config: dict[str, Any], command: str, ckpt: str | None) -> None:
    # @record writes this worker's traceback where the agent finds it, so the failure summary
    # names the rank and shows the real error.
    record(run_worker)(config, command, ckpt)


def _consolidate(source: str, output: str) -> int:
    consolidate(source, output)
    print(f"wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "checkpoint":
        return _consolidate(args.source, args.output)
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
        ckpt = checkpoint_for_launch(args.command, args.ckpt, trainer_cfg)
    except ConfigError as err:
        print(f"polytrain {args.command}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if plan.method == "here":
        run_worker(config, args.command, ckpt)
        return 0
    if plan.method in ("spawn", "fork"):
        try:
            launch_spawn(plan, run_worker, (config, args.command, ckpt))
        except ProcessRaisedException as err:  # the first failing worker's traceback; the others were stopped
            print(f"polytrain: a worker failed and the job was ended.{str(err).rstrip()}", file=sys.stderr)
            return 1
        return 0
    try:
        launch_elastic(plan, _elastic_entry, (config, args.command, ckpt), trainer_cfg.max_restarts)
    except ChildFailedError as err:
        print(err.format_msg(), file=sys.stderr)
        return 1
    return 0
