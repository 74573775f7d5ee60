"""``strategy: {name: parallel, plan: true}`` (or ``"auto"`` degrees) resolved when a stage starts.

The Trainer is built before it sees the module, so the layout is planned in ``Trainer._run``, once the
module and its train loader are known and before the strategy (and its device mesh) is built. Every
rank plans alike from the same inputs (the module's meta-device profile, one batch's shape, the world
size, the accelerator's hardware preset): nothing is broadcast, since no process group exists yet;
once it does, ``agree_on_plan`` checks with one tiny all-gather that every rank chose the same degrees.

The chosen layout is written into the config (``trainer.strategy.chosen``), so every checkpoint's
config holds it; a fit resuming from a checkpoint written at the same world size reuses that layout
rather than planning again (another world size plans again, and says so).
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from polytrain.checkpoint.reading import read_meta
from polytrain.core.batch import batch_size_of, map_tensors
from polytrain.core.errors import ConfigError
from polytrain.parallel.activation_checkpointing import resolve_checkpointing
from polytrain.parallel.float8 import resolve_float8
from polytrain.parallel.planner import Estimate, Training, hardware, profiler, rank_layouts
from polytrain.parallel.planner.search import world_check
from polytrain.parallel.planner.timing import SCHEDULES as PLANNED_SCHEDULES
from polytrain.strategies.launcher import LaunchPlan
from polytrain.strategies.plan_spec import CHOSEN_REQUIRED, DEGREES, is_planned, pinned_degrees
from polytrain.trainer.api.hooks import is_overridden
from polytrain.trainer.api.module import TrainModule
from polytrain.trainer.launch.traced_step import traced_step
from polytrain.trainer.persistence.run_directory import RunSources, resolve_path

if TYPE_CHECKING:
    from polytrain.trainer.configuration.config import TrainerConfig

log = logging.getLogger("polytrain")

OPTIMIZERS = {"Adam": "adam", "AdamW": "adamw"}
PRECISIONS = {"32-true": "32", "bf16": "bf16-mixed", "16": "16-mixed"}


def optimizer_kind(module: Any) -> tuple[str, str | None]:
    """The planner's name for the optimizer ``module.configure_optimizers()`` builds, and None; or AdamW
    and why it is assumed (the module cannot build its optimizer here, or builds one the planner does
    not know)."""
    try:
        made = module.configure_optimizers()
    except Exception as err:  # noqa: BLE001 - a module that cannot build its optimizer here plans as AdamW
        return "adamw", f"configure_optimizers() raised {type(err).__name__}: {str(err).splitlines()[0][:80]}"
    opt = (made[0] if isinstance(made, (tuple, list))
           else made.get("optimizer") if isinstance(made, dict) else made)
    name = type(opt).__name__
    if name == "SGD":
        return ("sgd_momentum" if opt.defaults.get("momentum", 0) else "sgd"), None
    if name not in OPTIMIZERS:
        return "adamw", f"{name} is not one the planner knows ({', '.join(sorted([*OPTIMIZERS, 'SGD']))})"
    return OPTIMIZERS[name], None


def as_built(module: Any) -> Any:
    """``module`` with the layers its ``configure_model`` builds, for the planner to profile: a copy,
    configured on the meta device (no memory for weights). The user's module is left as it is, to be
    configured by its own fit on its strategy's device."""
    if not is_overridden(module, "configure_model", TrainModule):
        return module
    built = copy.deepcopy(module)  # TrainModule.__getstate__ leaves the trainer out of the copy
    built._attach(module.__dict__.get("_trainer"))  # configure_model may read self.trainer
    with torch.device("meta"):
        built.configure_model()
    return built


def first_batch(loader: Any) -> Any:
    """The loader's first batch, as the loop would get it; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        try:
            return next(iter(loader))
        except StopIteration:
            raise ConfigError(f"the planner reads one batch of the train loader, and it yields none (its "
                              f"sampler holds {_length(loader)} samples, batch_size "
                              f"{getattr(loader, 'batch_size', '?')}, drop_last "
                              f"{getattr(loader, 'drop_last', '?')}): give it data") from None


def _length(loader: Any) -> str:
    try:
        return str(len(loader.sampler))
    except (AttributeError, TypeError):
        return "an unknown number of"


def one_sample(batch: Any) -> Any:
    """``batch`` cut to its first sample: every tensor whose leading dimension is the batch's, to one row;
    the structure (tuple, dict, dataclass, ``BatchEncoding``...) and everything else kept."""
    size = batch_size_of(batch)
    return map_tensors(batch, lambda t: t[:1] if t.dim() and t.shape[0] == size else t)


def step_profiler(module: Any, batch: Any, attention: str, sequential: str | None, precision: str,
                  device: str) -> Any:
    """The planner's ``tp -> ModelProfile`` for ``module`` on one sample of ``batch`` (any structure the loop
    takes). A model cut as one ``nn.Sequential`` is fed the batch's leading tensor (its pipeline's input,
    the next one the targets of ``pipeline_loss``); any other is traced through its own ``training_step``
    (``traced_step``: logs dropped, manual optimisation's backward calls summed into the loss)."""
    sample = one_sample(batch)
    inputs = sample if isinstance(sample, torch.Tensor) else None
    target = None
    if isinstance(sample, (tuple, list)) and sample and isinstance(sample[0], torch.Tensor):
        inputs = sample[0]
        target = sample[1] if len(sample) > 1 and isinstance(sample[1], torch.Tensor) else None
    profile_at = profiler(module, inputs, target, attention, sequential, precision=precision, device=device,
                          batch=sample, step=traced_step(module.__dict__.get("_trainer")))

    def named(tp: int) -> Any:
        try:
            return profile_at(tp)
        except ConfigError:
            raise
        except Exception as err:
            if tp > 1:  # the ranking lists it as a degree that does not split the model
                raise
            raise ConfigError(f"the planner runs {type(module).__name__}'s step once on one sample of the "
                              f"first train batch, on the meta device (no weights), and it raised "
                              f"{type(err).__name__}: {err}. Make the step run on meta tensors, or pin "
                              f"the degrees instead of planning") from err

    return named


def _train_loader(given: Any, datamodule: Any, module: Any) -> Any:
    if given is not None:
        return given
    source = datamodule if datamodule is not None else module
    try:
        return source.train_dataloader()
    except Exception as err:  # noqa: BLE001 - re-raised with what the planner needed it for
        raise ConfigError(f"plan: true reads one train batch before setup() runs (as `polytrain plan` "
                          f"does), and {type(source).__name__}.train_dataloader() raised: {err}. Build "
                          f"the dataset in __init__, pass train_dataloaders, or pin the degrees") from err


def _checkpoint_plan(sources: RunSources, stage: str,
                     ckpt_path: str | None) -> tuple[dict | None, str | None]:
    """The ``chosen`` layout stored in the checkpoint this fit resumes from (every rank reads it, as every
    rank will read the checkpoint itself), or (None, None)."""
    choice = ckpt_path if ckpt_path is not None else sources.config.resume
    if stage != "fit" or choice is None:
        return None, None
    path = resolve_path(sources, choice, ckpt_path is not None)
    if path is None:
        return None, None
    if os.path.isdir(path):
        payload = read_meta(path)
    else:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    spec = ((payload.get("config") or {}).get("trainer") or {}).get("strategy")
    return (spec.get("chosen") if isinstance(spec, dict) else None), path


def _plan(config: TrainerConfig, launch: LaunchPlan, module: Any, train: Any,
          datamodule: Any) -> dict[str, Any]:
    """Rank every layout of this job for ``module`` and return the best as a ``chosen`` mapping."""
    spec, world = config.strategy, launch.world_size
    batch = first_batch(_train_loader(train, datamodule, module))
    pinned = pinned_degrees(spec)
    checkpointing = resolve_checkpointing(config.activation_checkpointing)
    if checkpointing is not None:  # the config's mode is kept: full (True) or per-op ("op")
        pinned["activation_checkpointing"] = "op" if checkpointing["mode"] == "op" else True
        pinned["checkpoint_every"] = checkpointing["every"]
    on_cuda = launch.accelerator in ("cuda", "gpu")
    preset = spec.get("hardware") or (("a100" if "A100" in torch.cuda.get_device_name() else "h100")
                                      if on_cuda else "cpu")
    hw = hardware(preset, launch.num_nodes, max(world // launch.num_nodes, 1))
    world_check(hw, {k: v for k, v in pinned.items() if k in DEGREES})  # ep: not a factor of the world
    other = math.prod(pinned.get(k, 1) for k in ("tp", "pp", "cp"))
    global_batch = spec.get("global_batch") or batch_size_of(batch) * max(world // other, 1)
    precision = PRECISIONS.get(str(config.precision), str(config.precision))
    built = as_built(module)
    # float8 is costed when the config turns it on and the hardware has an fp8 peak (on CPU it is emulated)
    float8_options = resolve_float8(config.float8)
    float8 = float8_options is not None and bool(hw.fp8_peak_flops)
    # torch's optimizers step every parameter at once on CUDA, one at a time on CPU
    training = Training(global_batch=global_batch, precision=precision, optimizer=optimizer_kind(built)[0],
                        float8=float8, float8_tp=float8 and float8_options["recipe"] == "tensorwise",
                        foreach=on_cuda,
                        fsdp_float8_all_gather=float8 and float8_options["enable_fsdp_float8_all_gather"],
                        **schedule_settings(spec))
    # The SDPA kernel torch will run: flash on CUDA; on CPU flash too (fp32 included), but math (its s x s
    # matrices) under dropout
    attention = "flash" if on_cuda else "cpu"
    # Traced in the run's precision, under the autocast of the device it runs on
    profile_at = step_profiler(built, batch, attention, spec.get("sequential"), precision,
                               "cuda" if on_cuda else "cpu")
    plan = rank_layouts(hw, training, profile_at, pinned)
    chosen = chosen_layout(plan.best, world, preset)  # raises, with the first rejections, when nothing fits
    chosen["summary"] = (f"best of {len(plan.ranked)} layouts that fit ({len(plan.rejected)} rejected), "
                         f"global batch {global_batch}")
    return chosen


def chosen_layout(best: Estimate, world_size: int, preset: str) -> dict[str, Any]:
    """A ranked layout as ``trainer.strategy.chosen`` holds it: what a planned run trains with."""
    lay = best.layout
    return {"world_size": world_size, **{k: getattr(lay, k) for k in DEGREES}, "ep": lay.ep,
            "n_microbatches": lay.n_microbatches, "activation_checkpointing": lay.activation_checkpointing,
            "hardware": preset,
            "memory_bytes": int(best.total_memory), "step_s": float(best.step_time)}


def schedule_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The pipeline schedule and FSDP resharding the run will use (``schedule``, ``stages_per_rank``,
    ``reshard_after_forward`` of strategy ``parallel``), as the planner's ``Training`` takes them: plans
    must cost what runs. The planner models 1F1B and interleaved 1F1B; another schedule is refused unless
    ``pp`` is pinned to 1."""
    schedule = options.get("schedule", "1f1b")
    reshard = {"reshard_after_forward": options.get("reshard_after_forward")}
    if schedule in PLANNED_SCHEDULES:
        return {"pp_schedule": schedule, "stages_per_rank": int(options.get("stages_per_rank", 1) or 1),
                **reshard}
    if options.get("pp") == 1:
        return reshard
    raise ConfigError(f"trainer.strategy: the planner costs the pipeline schedules "
                      f"{', '.join(PLANNED_SCHEDULES)}, not schedule={schedule!r}; choose one of them, "
                      f"or pin pp: 1 (no pipeline)")


def describe(chosen: dict[str, Any]) -> str:
    degrees = " ".join(f"{k}={chosen[k]}" for k in DEGREES)
    if chosen.get("ep", 1) != 1:
        degrees += f" ep={chosen['ep']}"
    ac = {False: "off", True: "full", "op": "per-op"}.get(chosen["activation_checkpointing"], "on")
    line = f"{degrees} (n_microbatches {chosen['n_microbatches']}, activation checkpointing {ac})"
    if "memory_bytes" in chosen:
        line += (f": {chosen['memory_bytes'] / 1024**2:.1f} MiB per rank, "
                 f"predicted step {chosen['step_s']:.4g} s")
    return line + f" on {chosen['world_size']} {chosen.get('hardware', '')} ranks".replace("  ", " ")


def plan_layout(sources: RunSources, run_config: dict[str, Any] | None, launch: LaunchPlan, module: Any,
                train: Any, datamodule: Any, stage: str, ckpt_path: str | None) -> bool:
    """Resolve a planned ``trainer.strategy`` before the strategy is built; True when this call did (the
    same on every rank: it depends on the config only). The chosen layout goes into ``sources.config``
    and into ``run_config``, the run's whole config when it has one."""
    config = sources.config
    spec = config.strategy
    if not is_planned(spec):
        return False
    world = launch.world_size
    stored, source = _checkpoint_plan(sources, stage, ckpt_path)
    if stored is None and spec.get("chosen") is not None:
        stored, source = spec["chosen"], "the config (trainer.strategy.chosen)"
    pins = pinned_degrees(spec)
    if (stored is not None and stored["world_size"] == world
            and all(stored.get(k) == v for k, v in pins.items())):
        chosen, how = ({k: v for k, v in stored.items() if k != "summary"},
                       f"reusing the plan stored in {source}")
    else:
        if stored is not None:
            log.warning("the plan stored in %s (%s) is for %d ranks or other pinned degrees (%s) and this "
                        "job has %d ranks: planning again", source, describe(stored), stored["world_size"],
                        pins, world)
        chosen = _plan(config, launch, module, train, datamodule)
        how = chosen.pop("summary")
    _record(config, run_config, {**spec, "chosen": chosen})
    if launch.env.global_rank == 0:
        print(f"polytrain plan: {describe(chosen)}; {how}", flush=True)
    return True


def _record(config: TrainerConfig, run_config: dict[str, Any] | None, spec: dict[str, Any]) -> None:
    """The chosen layout into the config every checkpoint stores (the run's whole config, if it has one)."""
    config.strategy = spec
    if run_config is not None and "module" in run_config:  # Trainer.from_config: checkpoints store it
        run_config.setdefault("trainer", {})["strategy"] = dict(spec)


def agree_on_plan(strategy: Any, config: TrainerConfig) -> None:
    """Every rank chose the same layout (one all-gather of a few integers; every rank calls it)."""
    if strategy.world_size == 1:
        return
    chosen = config.strategy["chosen"]
    mine = {**{k: chosen[k] for k in CHOSEN_REQUIRED}, "ep": chosen.get("ep", 1)}
    every = strategy.all_gather_object(mine)
    if any(other != every[0] for other in every):
        differ = [r for r, other in enumerate(every) if other != every[0]]
        raise ConfigError(f"plan: true chose different layouts on different ranks (rank 0: {every[0]}; ranks "
                          f"{differ} differ): their inputs differ (data shapes, GPU models). Pin the degrees")
