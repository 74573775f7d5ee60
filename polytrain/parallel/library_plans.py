"""A library model's own tensor-parallel plan, in torch's parallel styles.

Hugging Face models say how they split: ``model._tp_plan`` maps module paths (``*`` for any block
index) to style names such as ``"colwise"`` or ``"embedding_rowwise"``, built from the config's
``base_model_tp_plan`` and the head's entries. A ``TrainModule`` that holds such a model and writes
no ``tensor_parallel_plan()`` of its own trains under tensor parallelism with that plan: the keys
get the attribute path of the model, the names become ``ColwiseParallel``/``RowwiseParallel`` with
the layouts the names stand for. transformers is never imported: the plan is read from the model
object the user built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from polytrain.core import lazy
from polytrain.core.errors import ConfigError


def _styles() -> dict[str, Callable[[], Any]]:
    """Each style name a plan may use -> the torch parallel style with the same layouts."""
    parallel = lazy.dtensor().parallel
    Replicate = lazy.dtensor().Replicate
    return {
        # a linear's output features split over the tp ranks; the next rowwise layer takes the shards
        "colwise": lambda: parallel.ColwiseParallel(),
        "rowwise": lambda: parallel.RowwiseParallel(),
        # a head whose output every rank needs whole (the logits the loss reads): gathered
        "colwise_rep": lambda: parallel.ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: parallel.ColwiseParallel(output_layouts=Replicate()),
        # a replicated input split on each rank before the layer
        "rowwise_rep": lambda: parallel.RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: parallel.RowwiseParallel(input_layouts=Replicate()),
        # an embedding table split by vocabulary rows: every rank looks up the tokens it holds, and the
        # partial rows are summed; split by columns, the output is gathered
        "embedding_rowwise": lambda: parallel.RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: parallel.ColwiseParallel(output_layouts=Replicate()),
    }


# Entries that keep a parameter whole on every rank: what polytrain does with any unplanned parameter.
_REPLICATED = {"replicate", "replicated_with_grad_allreduce"}
# ...of which these see only this rank's shard of the activations (Qwen3's per-head q_norm after a colwise
# q_proj): each rank's gradient is its heads' share, and the shares are summed over the tp ranks.
SUMMED = "replicated_with_grad_allreduce"


def library_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``module`` (``module`` itself included) that carry a Hugging Face
    plan attribute, with their paths."""
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if any(path.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue  # inside one found already: the outer model's plan covers it
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "base_model_tp_plan") and isinstance(
                getattr(sub, "_tp_plan", None), dict):
            found.append((path, sub))
    return found


def library_summed_keys(module: nn.Module) -> list[str]:
    """The plan keys, from ``module``, of the library models' parameters kept whole whose gradients are summed
    over the tp ranks (``SUMMED``); empty when the module gives a plan of its own."""
    own = [getattr(module, hook, None) for hook in ("tensor_parallel_plan", "parallelize")]
    if any(callable(hook) for hook in own):
        return []
    return [f"{path}.{key}" if path else key for path, model in library_models(module)
            for key, style in model._tp_plan.items() if style == SUMMED]


def library_plan(module: nn.Module) -> dict[str, Any] | None:
    """The plan of every Hugging Face model ``module`` holds, keyed from ``module`` as
    ``parallelize_module`` expects; None when it holds none or their plans are empty (GPT-2 has none).
    A style this translation does not know raises, naming the entry and the styles it knows."""
    styles = _styles()
    plan: dict[str, Any] = {}
    for path, model in library_models(module):
        for key, style in model._tp_plan.items():
            if style in _REPLICATED:
                continue
            if style not in styles:
                raise ConfigError(
                    f"{type(model).__name__}'s tensor-parallel plan (its _tp_plan) splits '{key}' as "
                    f"'{style}', which polytrain does not translate (it knows {', '.join(sorted(styles))}); "
                    f"define tensor_parallel_plan(self) on {type(module).__name__} with torch's parallel "
                    f"styles instead, or train it without tp")
            plan[f"{path}.{key}" if path else key] = styles[style]()
    return plan or None
