"""``polytrain plan -c cfg.yaml --nodes N --devices-per-node G``: the ranked layouts for a config's model.

The module is built on the meta device (no memory for weights: a 70B model plans on a laptop); one
batch of its train dataloader gives the input's shape; the cost model is docs/strategies/planner.md's.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from polytrain.core.batch import batch_size_of
from polytrain.core.errors import ConfigError
from polytrain.parallel.float8 import resolve_float8
from polytrain.parallel.planner import PRESETS, Training, format_table, hardware, parse_bytes, rank_layouts
from polytrain.parallel.planner.model_profile import ATTENTION_KERNELS
from polytrain.parallel.planner.search import describe_time
from polytrain.trainer.api.datamodule import DataModule
from polytrain.trainer.api.hooks import is_overridden
from polytrain.trainer.configuration.config import instantiate, load_config
from polytrain.trainer.launch.planned import (
    as_built,
    first_batch,
    optimizer_kind,
    schedule_settings,
    step_profiler,
)
from polytrain.trainer.trainer import Trainer


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="rank parallel layouts for a config's model on given hardware")
    p.add_argument("--config", "-c", required=True, help="the YAML config whose module: is planned")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--hardware", choices=sorted(PRESETS), default=None,
                   help="figures for peak FLOPs, bandwidths, latencies (docs/strategies/planner.md); "
                        "default: cpu when the config's trainer.accelerator is cpu, else h100")
    p.add_argument("--device-memory", default=None, help="per device, e.g. 80GiB (default: the preset's)")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of peak FLOPs reached (MFU)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per device inside a node")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per device between nodes")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default: the dataloader's batch x the config's "
                        "data-parallel size)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default=None,
                   help="SDPA kernel whose saved tensors count (default: what torch runs on the hardware: "
                        "flash on a GPU; cpu on cpu, which is flash but math under dropout; math: the s x s "
                        "matrix, e.g. for a model passing attn_mask)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


def float8_note(asked: bool, costed: bool, preset: str) -> str:
    if costed:
        return ", float8 linears"
    return f", float8 not costed ({preset} has no fp8 peak)" if asked else ""


def experts_note(profile: Any) -> str:
    """The model's experts, whose ``ep`` layouts the ranking includes (nothing for a dense model)."""
    if not profile.experts:
        return ""
    counts = "/".join(str(c) for c in profile.expert_counts)
    return (f", {len(profile.experts)} experts modules of {counts} experts, top {profile.top_k} "
            f"(ep ranked)")


def _train_loader(source: Any) -> Any:
    """The train loader a fit would read (a DataModule's built by its ``setup("fit")``, as in a fit)."""
    try:
        if isinstance(source, DataModule) and is_overridden(source, "setup", DataModule):
            source.setup("fit")
        return source.train_dataloader()
    except Exception as err:  # noqa: BLE001 - re-raised with what the planner needed it for
        raise ConfigError(f"polytrain plan reads one batch of the train loader, and "
                          f"{type(source).__name__}.train_dataloader() raised {type(err).__name__}: {err}"
                          ) from err


def _config_dp(trainer: dict[str, Any], world: int) -> int:
    spec = trainer.get("strategy")
    options = spec if isinstance(spec, dict) else {}
    other = math.prod(max(v, 1) if isinstance(v := options.get(k, 1), int) else 1 for k in ("tp", "pp", "cp"))
    return max(world // other, 1)


def run_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    trainer = config["trainer"]
    preset = args.hardware or ("cpu" if trainer.get("accelerator") == "cpu" else "h100")
    chosen = "" if args.hardware else f" (from trainer.accelerator={trainer.get('accelerator')})"
    with torch.device("meta"):
        module = instantiate(config["module"], "module", config.get("config_dir"))
    # configure_optimizers may read self.trainer (its max_epochs, say): a Trainer of the config, never fitted.
    module._attach(Trainer.from_config(config))
    module = as_built(module)  # the layers configure_model builds (on meta), as a fit would build them
    optimizer, assumed = optimizer_kind(module)
    data = instantiate(config["data"], "data", config.get("config_dir")) if config.get("data") else None
    batch = first_batch(_train_loader(data if data is not None else module))
    gbps = {k: getattr(args, f"{k}_node_gbps") for k in ("intra", "inter")}
    hw = hardware(preset, args.nodes, args.devices_per_node,
                  memory_bytes=parse_bytes(args.device_memory) if args.device_memory else None,
                  efficiency=args.efficiency,
                  peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                  intra_bw=gbps["intra"] * 1e9 if gbps["intra"] else None,
                  inter_bw=gbps["inter"] * 1e9 if gbps["inter"] else None)
    devices = trainer.get("devices", 1)
    world = (devices if isinstance(devices, int) else 1) * int(trainer.get("num_nodes", 1) or 1)
    global_batch = args.global_batch or batch_size_of(batch) * _config_dp(trainer, world)
    precision = str(trainer.get("precision", "32"))
    options = trainer.get("strategy") if isinstance(trainer.get("strategy"), dict) else {}
    # float8 is costed when the config turns it on and the hardware has an fp8 peak (on CPU it is emulated)
    float8_options = resolve_float8(trainer.get("float8"))
    float8 = float8_options is not None and bool(hw.fp8_peak_flops)
    # torch's optimizers step every parameter at once on CUDA, one at a time on CPU
    train = Training(global_batch=global_batch, precision=precision, optimizer=optimizer, float8=float8,
                     fsdp_float8_all_gather=float8 and float8_options["enable_fsdp_float8_all_gather"],
                     float8_tp=float8 and float8_options["recipe"] == "tensorwise", foreach=preset != "cpu",
                     **schedule_settings(options))
    attention = args.attention or ("cpu" if preset == "cpu" else "flash")
    # Traced in the run's precision, under the autocast of the device it runs on
    profile_at = step_profiler(module, batch, attention, options.get("sequential"), precision,
                               "cpu" if preset == "cpu" else "cuda")
    plan = rank_layouts(hw, train, profile_at)
    optimizer_said = f"{train.optimizer} (assumed: {assumed})" if assumed else train.optimizer
    print(f"plan for {type(module).__name__} ({sum(p.numel() for p in module.parameters()):,} parameters) on "
          f"{hw.nodes} x {hw.devices_per_node} {preset}{chosen} ({hw.memory_bytes / 1024**3:.0f} GiB each); "
          f"global batch {global_batch}, precision {precision}, optimizer {optimizer_said}, attention "
          f"{attention}, pipeline schedule {train.pp_schedule}"
          f"{float8_note(float8_options is not None, train.float8, preset)}"
          f"{' (FSDP gathers them in float8)' if train.fsdp_float8_all_gather else ''}"
          f"{experts_note(profile_at(1))}")
    print(format_table(plan, top=args.top, capacity=hw.memory_bytes))
    if plan.ranked:
        print("best: " + describe_time(plan.best))
        return 0
    raise ConfigError(f"no layout fits on {hw.world_size} devices; see the rejected list above")
