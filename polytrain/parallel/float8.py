"""Float8 training (torchao) as plain functions: which ``nn.Linear`` layers convert, and converting them.

``trainer.float8: true`` (or a mapping, torchtitan's vocabulary) swaps the chosen ``nn.Linear`` layers
for torchao's ``Float8Linear``: its matmuls cast inputs, weights and output gradients to float8 with a
dynamic scale (the amax of each tensor, per tensor or per row by recipe) and keep the weights, their
gradients and the optimizer in the model's own dtype. Converted:

- every ``nn.Linear`` whose ``in_features`` and ``out_features`` are multiples of 16 (what float8
  matmuls take); the others are skipped, and the log says which;
- not the output head (the model's last ``nn.Linear``, the logits: torchtitan leaves it in high
  precision too) unless ``convert_head: true``; not a layer whose name contains one of ``filter_fqns``;
- under tensor parallelism, not a layer with a bias (``keep_biased_layers_in_high_precision``).

Where nothing converts, ``float8: true`` is an error naming every candidate and why (``nothing_converts``):
the run would otherwise train in full precision without a word.

The conversion runs once, on the module as ``configure_model`` left it, before the strategy applies
anything (the order is float8 -> TP -> activation checkpointing -> compile -> FSDP, as torchtitan's).
A converted layer keeps ``weight`` and ``bias`` under their names, so checkpoints load into a run with
float8 off, and back.

``enable_fsdp_float8_all_gather: true`` (``tensorwise`` only) has FSDP gather the converted weights in
float8, cast on each rank's shard with the whole weight's scale: a quarter of the fp32 bytes, half of
bf16's, and the same bits a cast after the gather would give. The scales then come from one all-reduce
of every converted weight's amax after each optimizer step (``precompute_float8_dynamic_scale_for_fsdp``,
on by default as in torchtitan) instead of one a weight inside each gather.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.core import lazy
from polytrain.core.errors import ConfigError, first_few

log = logging.getLogger("polytrain")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
KEYS = ("recipe", "filter_fqns", "convert_head", "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp")
MULTIPLE = 16  # float8 matmuls take dimensions divisible by 16
EXTRA = "pip install 'polytrain[float8]' (torchao)"


def resolve_float8(spec: Any, key: str = "trainer.float8") -> dict[str, Any] | None:
    """The config value as ``{recipe, filter_fqns, convert_head, ..., auto}``, or None when off. ``auto``:
    the defaults, on where the device has float8 matmuls (``has_float8_matmuls``), off elsewhere."""
    if spec is None or spec is False:
        return None
    auto = spec == "auto"
    if spec is True or auto:
        spec = {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}={spec!r} is not valid; use true, false, auto, or a mapping such as "
                          f"{{recipe: tensorwise, filter_fqns: [lm_head]}}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ConfigError(f"{key} has unknown key(s) {unknown}; valid: {', '.join(KEYS)}")
    recipe = spec.get("recipe", "tensorwise")
    if recipe not in RECIPES:
        raise ConfigError(f"{key}.recipe={recipe!r} is not one of torchao's recipes: {', '.join(RECIPES)}")
    fqns = spec.get("filter_fqns", [])
    if isinstance(fqns, str):
        fqns = [fqns]
    if not isinstance(fqns, (list, tuple)) or not all(isinstance(f, str) for f in fqns):
        raise ConfigError(f"{key}.filter_fqns={spec.get('filter_fqns')!r} must be a list of name fragments "
                          f"(a Linear whose name contains one stays in high precision)")
    flags = {name: spec.get(name, default) for name, default in (
        ("convert_head", False), ("enable_fsdp_float8_all_gather", False),
        ("precompute_float8_dynamic_scale_for_fsdp", True))}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{key}.{name}={value!r} must be true or false")
    if flags["enable_fsdp_float8_all_gather"] and recipe != "tensorwise":
        raise ConfigError(f"{key}.enable_fsdp_float8_all_gather needs recipe: tensorwise (one scale a "
                          f"weight, which every shard can share); {recipe} scales each row. Use tensorwise, "
                          f"or gather in high precision (enable_fsdp_float8_all_gather: false)")
    if not auto:
        _torchao_float8()  # with the config's other errors: before the launcher starts any worker
    return {"recipe": recipe, "filter_fqns": list(fqns), **flags, "auto": auto}


def has_float8_matmuls(device: torch.device) -> bool:
    """Whether ``device`` multiplies in float8: CUDA compute capability 8.9 or later (Ada, Hopper and on).
    Elsewhere torchao emulates the matmuls: right, not faster."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def linears_to_convert(module: nn.Module, options: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(names of the Linear layers that convert, {name: why not} for the Linear layers that do not)."""
    linears = [(name, m) for name, m in module.named_modules() if type(m) is nn.Linear]
    head = linears[-1][0] if linears and not options["convert_head"] else None
    chosen, skipped = [], {}
    for name, linear in linears:
        fragment = next((f for f in options["filter_fqns"] if f in name), None)
        if name == head:
            skipped[name] = "the output head (convert_head: true converts it)"
        elif fragment is not None:
            skipped[name] = f"filter_fqns names '{fragment}'"
        elif linear.in_features % MULTIPLE or linear.out_features % MULTIPLE:
            skipped[name] = (f"{linear.in_features} x {linear.out_features} features: float8 matmuls take "
                             f"multiples of {MULTIPLE}")
        else:
            chosen.append(name)
    return chosen, skipped


def convert_to_float8(module: nn.Module, options: dict[str, Any]) -> list[str]:
    """Swap the chosen Linear layers of ``module`` for torchao's ``Float8Linear`` (in place); returns their
    names. Layers converted already stay as they are, so a second stage converts nothing new. Asked for
    (not ``auto``) where no layer can convert, it is an error naming every candidate and why not."""
    torchao_float8 = _torchao_float8()
    chosen, skipped = linears_to_convert(module, options)
    if not chosen:
        if not has_float8(module):
            nothing_converts(module, skipped, options)
        return []
    wanted = set(chosen)
    config = torchao_float8.Float8LinearConfig.from_recipe_name(options["recipe"])
    if options["enable_fsdp_float8_all_gather"]:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    torchao_float8.convert_to_float8_training(module, config=config,
                                              module_filter_fn=lambda _m, name: name in wanted)
    log.info("float8 (%s): %d Linear layers converted; kept in high precision: %s", options["recipe"],
             len(chosen), "; ".join(f"{n} ({why})" for n, why in skipped.items()) or "none")
    return chosen


def nothing_converts(module: nn.Module, skipped: dict[str, str], options: dict[str, Any]) -> None:
    """``float8: true`` on a model with no layer to convert would train in full precision, silently: an
    error naming the Linear layers and why each stays, and the layers that look like Linear but are not
    one (Hugging Face's ``Conv1D``). ``auto`` logs it instead."""
    reasons = [f"{name} ({why})" for name, why in skipped.items()]
    lookalikes: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(m, nn.Linear)
                and not isinstance(m, (nn.Embedding, nn.EmbeddingBag))):
            lookalikes.setdefault(f"{type(m).__module__}.{type(m).__qualname__}", []).append(name)
    for cls, names in lookalikes.items():
        reasons.append(f"{len(names)} {cls.rsplit('.', 1)[-1]} layer(s) ({first_few(names)}): {cls} is not "
                       f"torch.nn.Linear, the only layer float8 converts")
    what = "; ".join(reasons) or "the model has no torch.nn.Linear layer"
    if options["auto"]:
        log.info("float8: auto converts nothing: %s", what)
        return
    raise ConfigError(f"trainer.float8 converts no layer of {type(module).__name__}, so it would train in "
                      f"full precision: {what}. Set trainer.float8: false, or give it layers it converts "
                      f"(convert_head: true for the head, filter_fqns narrower)")


def precompute_scales_after_each_step(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Where FSDP gathers ``module``'s float8 weights and the options ask it, compute their next scales
    after every optimizer step: one all-reduce of every weight's amax, which each gather then reads."""
    layers = [m for m in module.modules() if _is_float8(m)]
    if not any(getattr(m.config, "enable_fsdp_float8_all_gather", False) for m in layers):
        return
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for optimizer in optimizers:
        optimizer.register_step_post_hook(lambda *_: precompute(module))


def _torchao_float8() -> Any:
    """torchao's float8 package, its tensor-parallel styles loaded too."""
    try:
        import torchao.float8.float8_tensor_parallel  # late: an optional extra
    except ImportError as err:
        raise ConfigError(f"trainer.float8 needs torchao, which is not installed ({err}): {EXTRA}") from None
    return torchao.float8


def with_float8_styles(module: nn.Module, plan: dict[str, Any] | None,
                       names_of: Callable[[nn.Module, str], list[str]]) -> dict[str, Any] | None:
    """``plan`` with torchao's float8 styles on the converted layers: a ``ColwiseParallel`` or
    ``RowwiseParallel`` entry reaching a ``Float8Linear`` becomes ``Float8ColwiseParallel`` /
    ``Float8RowwiseParallel`` with the same layouts, so the layer casts its input to float8 before the
    collectives (they move one byte an element) and its output gradient in backward. ``names_of`` lists
    the module names a key reaches (``tensor_parallel.resolve_key``); a key reaching converted and plain
    layers is split into their names."""
    if not has_float8(module):
        return plan
    if plan is not None:
        keep_biased_layers_in_high_precision(module, plan, names_of)
    if plan is None:
        raise ConfigError("trainer.float8 with a module's own parallelize(tp_mesh): its styles would not "
                          "cast to float8. Give tensor_parallel_plan() instead (ColwiseParallel/"
                          "RowwiseParallel entries become torchao's float8 styles on the converted layers), "
                          "or turn float8 off")
    rowwise = [name for name, m in module.named_modules() if _is_float8(m) and not _tensorwise(m)]
    if rowwise:
        raise ConfigError(f"trainer.float8 with tensor parallelism (tp > 1) needs recipe: tensorwise: "
                          f"torchao's float8 styles move one scale a tensor, and {rowwise[0]} scales per row "
                          f"(recipe rowwise or rowwise_with_gw_hp). Use recipe: tensorwise, or tp 1")
    styles = _torchao_float8().float8_tensor_parallel
    parallel = lazy.dtensor().parallel
    float8_style = {parallel.ColwiseParallel: styles.Float8ColwiseParallel,
                    parallel.RowwiseParallel: styles.Float8RowwiseParallel}
    out: dict[str, Any] = {}
    for key, style in plan.items():
        names = names_of(module, key)
        converted = [name for name in names if _is_float8(module.get_submodule(name))]
        if not converted:
            out[key] = style
            continue
        if type(style) not in float8_style:
            raise ConfigError(f"tensor-parallel plan entry '{key}' gives the float8 layer(s) {converted} the "
                              f"style {type(style).__name__}; float8 layers take ColwiseParallel or "
                              f"RowwiseParallel (torchao's float8 styles), or keep them in high precision "
                              f"with trainer.float8.filter_fqns")
        swapped = float8_style[type(style)](input_layouts=style.input_layouts[0],
                                            output_layouts=style.output_layouts[0],
                                            use_local_output=style.use_local_output)
        if len(converted) == len(names):
            out[key] = swapped
        else:
            out.update({name: swapped if name in converted else style for name in names})
    return out


def keep_biased_layers_in_high_precision(module: nn.Module, plan: dict[str, Any],
                                        names_of: Callable[[nn.Module, str], list[str]]) -> None:
    """Converted layers with a bias that ``plan`` splits go back to ``nn.Linear`` (the same parameters).
    torchao's float8 tensor-parallel styles cast a layer's output gradient to float8 at the layer's output,
    after its bias was added, so the bias would learn from the float8 gradient; one process's bias learns
    from the high-precision one (tests/test_float8.py measures how far that moves the weights). Kept in
    high precision, the layer trains as one process trains it."""
    biased = sorted({name for key in plan for name in names_of(module, key)
                     if _is_float8(layer := module.get_submodule(name)) and layer.bias is not None})
    if not biased:
        return
    for name in biased:
        parent, _, child = name.rpartition(".")
        layer = module.get_submodule(name)
        plain = nn.Linear(layer.in_features, layer.out_features, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        setattr(module.get_submodule(parent) if parent else module, child, plain)
    log.info("float8: %d Linear layer(s) with a bias stay in high precision under tensor parallelism: %s "
             "(torchao's float8 tensor-parallel styles would give the bias a float8 gradient; "
             "a layer without bias converts)", len(biased), first_few(biased, 6))
    if not has_float8(module):
        raise ConfigError(f"trainer.float8 converts no layer of {type(module).__name__} under tensor "
                          f"parallelism: every converted layer has a bias ({first_few(biased)}), and "
                          f"torchao's float8 tensor-parallel styles would give the bias a float8 gradient, "
                          f"so they stay in high precision. Set trainer.float8: false, or use layers without "
                          f"bias")


def _tensorwise(layer: nn.Module) -> bool:
    config = layer.config
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(cast.scaling_granularity.name == "TENSORWISE" for cast in casts)


def has_float8(module: nn.Module) -> bool:
    """Whether ``module`` holds a converted layer."""
    return any(_is_float8(m) for m in module.modules())


def _is_float8(module: nn.Module) -> bool:
    # By class name (torchao is optional), through the class FSDP makes of it (FSDPFloat8Linear)
    return any(c.__name__ == "Float8Linear" for c in type(module).__mro__)
