"""``polytrain fit|validate|test|predict --config cfg.yaml key=value ...``, ``polytrain checkpoint`` and
``polytrain plan``: the command line, parsed before anything heavy loads, so ``--help``, a malformed
command and a typo in the config's trainer keys answer at once
(``trainer/configuration/config_file.py``). What a command runs (torch, the Trainer, the launcher) is
``polytrain.commands``, imported only then;
``polytrain plan``'s own options come with the planner (``plan_cli``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

STAGES = ("fit", "validate", "test", "predict")


def _parser(plan: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polytrain", description="One Trainer, many parallelisms.")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"{stage} a TrainModule described by a YAML config")
        p.add_argument("--config", "-c", required=True,
                       help="YAML file with module:, data: (or datamodule:) and trainer:")
        p.add_argument("--ckpt", default=None,
                       help="checkpoint: a path (a file or a sharded directory), 'last' (the newest of "
                            "the newest run), 'best' (the best a ModelCheckpoint recorded) or 'auto'")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_epochs=3")
    ck = sub.add_parser("checkpoint", help="checkpoint utilities")
    ck_sub = ck.add_subparsers(dest="action", required=True)
    cons = ck_sub.add_parser("consolidate",
                             help="write a checkpoint's model weights as one plain state_dict file")
    cons.add_argument("source", help="a checkpoint file or sharded checkpoint directory")
    cons.add_argument("output", help="where to write the state_dict (torch.save format)")
    export = ck_sub.add_parser("export", help="write a checkpoint's Hugging Face model as a directory "
                                              "from_pretrained reads (config.json, safetensors)")
    export.add_argument("source", help="a checkpoint file or sharded checkpoint directory")
    export.add_argument("output", help="the new directory to write (it must not exist)")
    export.add_argument("--format", choices=["hf"], required=True,
                        help="hf: Hugging Face's (save_pretrained's layout)")
    export.add_argument("--model", default=None, metavar="PATH",
                        help="which of the module's Hugging Face models (its attribute path, e.g. "
                             "backbone); default: the first")
    export.add_argument("--max-shard-size", type=float, default=5.0, metavar="GB",
                        help="split the weights into files of at most this many GB (default 5, as "
                             "save_pretrained), listed in model.safetensors.index.json")
    if plan:  # the planner's options (hardware presets) load torch: only when planning
        importlib.import_module("polytrain.plan_cli").add_parser(sub)
    else:
        sub.add_parser("plan", help="rank parallel layouts for a config's model on given hardware",
                       add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(plan=bool(argv) and argv[0] == "plan").parse_args(argv)
    if args.command in STAGES:
        # The config's file, sections and trainer keys checked before torch loads: a typo answers at once.
        config_file = importlib.import_module("polytrain.trainer.configuration.config_file")
        try:
            config_file.first_check(args.config, args.overrides)
        except config_file.ConfigError as err:
            print(f"polytrain: config error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    return importlib.import_module("polytrain.commands").run(args)
