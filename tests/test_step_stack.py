"""The training step as it runs: the real call stack, recorded at ``optimizer.step()`` and at the user's
``training_step``, from ``Trainer.fit`` down. Each executor's ``train_step`` is on it; no polytrain function
appears twice, and no polytrain object is called again once another object's frames lie above its own (no
call back into the caller). Under one process (the whole model, with and without the closure an LBFGS
needs, under 16-mixed with clipping and accumulation), ddp x2 and a two-stage pipeline."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_dataset
from distributed import run_distributed
from torch import nn
from torch.utils.data import DataLoader

import polytrain
from polytrain import Trainer, TrainModule

pytestmark = pytest.mark.own_logic

PACKAGE = os.path.dirname(polytrain.__file__)


def _stack() -> list[tuple[str, int | None, bool]]:
    """``(qualified name, id of self or None, polytrain's own)`` for each frame from ``Trainer.fit`` down to
    the caller's caller, outermost first."""
    frames = []
    for info in inspect.stack()[2:]:
        code, owner = info.frame.f_code, info.frame.f_locals.get("self")
        frames.append((code.co_qualname, id(owner) if owner is not None else None,
                       os.path.abspath(code.co_filename).startswith(PACKAGE)))
    frames.reverse()
    start = max(i for i, frame in enumerate(frames) if frame[0] == "Trainer.fit")
    return frames[start:]


def _problems(stack: list[tuple[str, int | None, bool]]) -> list[str]:
    own = [(name, owner) for name, owner, ours in stack if ours]
    names = [name for name, _ in own]
    problems = [f"{name} runs twice" for name in sorted({n for n in names if names.count(n) > 1})]
    seen_owner: dict[int, int] = {}  # id -> position of its latest frame
    for position, (name, owner) in enumerate(own):
        if owner is None:
            continue
        if owner in seen_owner and seen_owner[owner] != position - 1:
            between = [n for n, _ in own[seen_owner[owner] + 1:position]]
            problems.append(f"{name} calls back into an object already on the stack, through {between}")
        seen_owner[owner] = position
    return problems


class Recorded(TrainModule):
    """A regression whose training_step and optimizer record the stack once, on their first call."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer = optimizer
        self.stacks: dict[str, list[tuple[str, int | None, bool]]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.stacks.setdefault("training_step", _stack())
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=2)


def _names(stack: list[tuple[str, int | None, bool]]) -> list[str]:
    return [name for name, _, ours in stack if ours]


def _fit(module: Recorded, **options: Any) -> dict[str, list[tuple[str, int | None, bool]]]:
    """Fit ``module`` with torch's own optimizer classes watched: their ``step`` is replaced on the class
    for the fit (a subclass would be a different optimizer to the step), then restored."""
    trainer = Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", **options)
    originals = {cls: cls.step for cls in (torch.optim.SGD, torch.optim.LBFGS)}

    def watched(original: Any) -> Any:
        def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
            module.stacks.setdefault("optimizer.step", _stack())
            return original(self, closure)

        return step

    try:
        for cls, original in originals.items():
            cls.step = watched(original)
        trainer.fit(module, DataLoader(make_dataset(32, 4, seed=0), batch_size=8))
    finally:
        for cls, original in originals.items():
            cls.step = original
    return module.stacks


def test_the_whole_models_step_reads_straight_down_to_optimizer_step() -> None:
    stacks = _fit(Recorded())
    at_step = _names(stacks["optimizer.step"])
    # The loop hands the batch to the executor's train_step, whose update calls the precision's step.
    assert at_step[-4:] == ["TrainingEpochLoop.run_batch", "StepExecutor.train_step", "StepExecutor.update",
                            "Precision.step"], at_step
    assert _names(stacks["training_step"])[-3:] == ["TrainingEpochLoop.run_batch", "StepExecutor.train_step",
                                                    "WholeModel.forward_backward"]
    for where, stack in stacks.items():
        assert not _problems(stack), (where, _problems(stack), _names(stack))


def test_scaler_clipping_and_accumulation_add_no_hop() -> None:
    stacks = _fit(Recorded(), precision="16-mixed", gradient_clip_val=0.5, accumulate_grad_batches=2)
    assert _names(stacks["optimizer.step"])[-3:] == ["StepExecutor.train_step", "StepExecutor.update",
                                                     "Precision.step"]
    for where, stack in stacks.items():
        assert not _problems(stack), (where, _problems(stack), _names(stack))


def test_an_optimizer_that_takes_the_closure_runs_the_same_forward_backward() -> None:
    stacks = _fit(Recorded("lbfgs"))
    assert _names(stacks["optimizer.step"])[-3:] == ["StepExecutor.train_step",
                                                     "StepExecutor.train_step_through_closures",
                                                     "StepExecutor.update"]
    # LBFGS calls the closure from inside its step: the same forward_backward, through the closure.
    assert _names(stacks["training_step"])[-4:] == ["StepExecutor.update",
                                                    "StepExecutor.update.<locals>.closure_then_finish",
                                                    "Closure.__call__", "WholeModel.forward_backward"]
    assert not _problems(stacks["optimizer.step"]), _problems(stacks["optimizer.step"])
    # A closure is a call back by nature (torch's optimizer calls it): no function twice, though.
    assert not [p for p in _problems(stacks["training_step"]) if "twice" in p]


def test_the_checks_catch_a_call_back() -> None:
    """The rule the tests above apply: a function twice, or an object re-entered from another's frame."""
    stack = [("Trainer.fit", 1, True), ("Strategy.step", 2, True), ("Executor.run", 3, True),
             ("Strategy.forward", 2, True), ("Strategy.step", 2, True)]
    assert _problems(stack) == ["Strategy.step runs twice",
                                "Strategy.forward calls back into an object already on the stack, through "
                                "['Executor.run']"]
    assert not _problems([("A.f", 1, True), ("A.g", 1, True), ("B.h", 2, True), ("torch", 4, False)])


def _distributed_stacks(rank: int, world: int, strategy: Any) -> dict[str, tuple[list[str], list[str]]]:
    stacks = _fit(Recorded(), strategy=strategy, devices=world)
    return {where: (_names(stack), _problems(stack)) for where, stack in stacks.items()}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_under_ddp_and_a_pipeline_the_stack_is_as_straight() -> None:
    for rank_stacks in run_distributed(_distributed_stacks, 2, "ddp", timeout=120):
        names, problems = rank_stacks["optimizer.step"]
        assert names[-4:] == ["TrainingEpochLoop.run_batch", "StepExecutor.train_step", "StepExecutor.update",
                              "Precision.step"] and not problems, (names, problems)
        names, problems = rank_stacks["training_step"]  # then DDP's wrapper and the step router
        at = names.index("StepExecutor.train_step")
        assert names[at + 1] == "WholeModel.forward_backward" and not problems, (names, problems)
    pipeline = {"name": "parallel", "pp": 2, "schedule": "gpipe", "n_microbatches": 2}
    for rank_stacks in run_distributed(_distributed_stacks, 2, pipeline, timeout=120):
        names, problems = rank_stacks["optimizer.step"]
        assert names[-4:] == ["TrainingEpochLoop.run_batch", "StepExecutor.train_step", "StepExecutor.update",
                              "Precision.step"] and not problems, (names, problems)
