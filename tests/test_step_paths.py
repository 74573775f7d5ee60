"""The two ways an automatic-optimisation batch runs give what plain PyTorch gives.

With torch's own closure-first optimizers (every one but LBFGS) the step runs training_step, backward and
``optimizer.step()`` without a closure; an optimizer that needs one (LBFGS, a subclass, one with a step
pre-hook) or a module's ``optimizer_step`` gets the closure, as Lightning hands it. References are
hand-written PyTorch loops.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_dataset
from torch.utils.data import DataLoader

from polytrain import Callback

pytestmark = pytest.mark.own_logic


def _hand_weights(make_optimizer: Any, closure_style: bool, batches: int = 4) -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = make_optimizer(net.parameters())
    for x, y in DataLoader(make_dataset(16, 4, seed=0), batch_size=4):
        if closure_style:
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = F.mse_loss(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                return loss

            opt.step(closure)
        else:
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.cat([net.weight.detach().reshape(-1), net.bias.detach()])


def _weights(module: TinyModule) -> torch.Tensor:
    return torch.cat([module.net.weight.detach().reshape(-1), module.net.bias.detach()])


class _Recorded(TinyModule):
    def __init__(self, make_optimizer: Any) -> None:
        torch.manual_seed(0)
        super().__init__(val_n=None)
        self.make_optimizer = make_optimizer
        self.events: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.events.append("training_step")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(self.parameters())


def test_lbfgs_gets_the_closure_and_matches_plain_pytorch(make_trainer: Any) -> None:
    """LBFGS calls the closure several times per step: the closure path, training_step each time."""
    def lbfgs(params: Any) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(params, lr=0.5, max_iter=3)

    module = _Recorded(lbfgs)
    make_trainer(max_epochs=1).fit(module)
    assert module.events.count("training_step") > 4  # more forward passes than batches
    torch.testing.assert_close(_weights(module), _hand_weights(lbfgs, closure_style=True), rtol=0, atol=0)


def test_a_step_pre_hook_sees_lightnings_order(make_trainer: Any) -> None:
    """A step pre-hook runs before the closure in Lightning (inside optimizer.step): an optimizer that has
    one when the fit starts gets the closure, so the hook runs before training_step, and the weights stay
    those of plain PyTorch."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    class Hooked(_Recorded):
        def configure_optimizers(self) -> Any:
            optimizer = super().configure_optimizers()
            optimizer.register_step_pre_hook(lambda *_: self.events.append("pre_hook"))
            return optimizer

    module = Hooked(sgd)
    make_trainer(max_epochs=1).fit(module)
    assert module.events == ["pre_hook", "training_step"] * 4
    expected = _hand_weights(sgd, closure_style=False)
    torch.testing.assert_close(_weights(module), expected, rtol=0, atol=0)
    torch.testing.assert_close(_hand_weights(sgd, closure_style=True), expected, rtol=0, atol=0)


def test_a_step_pre_hook_registered_mid_fit_runs_where_a_hand_loop_runs_it(make_trainer: Any) -> None:
    """Whether the step needs a closure is settled when the fit starts: a step pre-hook registered later
    runs inside ``optimizer.step()`` after backward, as in a hand-written loop; the weights are the same."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    class RegisterAfterFirstBatch(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if batch_idx == 0:
                trainer.optimizers[0].register_step_pre_hook(
                    lambda *_: module.events.append("pre_hook"))

    module = _Recorded(sgd)
    make_trainer(max_epochs=1, callbacks=[RegisterAfterFirstBatch()]).fit(module)
    assert module.events == ["training_step"] + ["training_step", "pre_hook"] * 3
    torch.testing.assert_close(_weights(module), _hand_weights(sgd, closure_style=False), rtol=0, atol=0)


def test_a_subclassed_optimizer_keeps_the_closure(make_trainer: Any) -> None:
    """Only torch's own optimizer classes run without a closure: a subclass may use it its own way."""
    seen: list[bool] = []

    class MySGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.append(closure is not None)
            return super().step(closure)

    module = _Recorded(lambda params: MySGD(params, lr=0.1))
    make_trainer(max_epochs=1).fit(module)
    assert seen == [True] * 4
    torch.testing.assert_close(_weights(module), _hand_weights(lambda p: torch.optim.SGD(p, lr=0.1), False),
                               rtol=0, atol=0)


def test_torch_optimizers_step_without_a_closure(make_trainer: Any, sgd_closures: list[bool]) -> None:
    """SGD.step gets no closure, without and with clipping between backward and the update; both end on
    plain PyTorch's weights."""
    closures = sgd_closures

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    module = _Recorded(sgd)
    make_trainer(max_epochs=1).fit(module)
    assert closures == [False] * 4
    torch.testing.assert_close(_weights(module), _hand_weights(sgd, closure_style=False), rtol=0, atol=0)

    closures.clear()
    clipped = _Recorded(sgd)
    make_trainer(max_epochs=1, gradient_clip_val=1e6).fit(clipped)  # never binds: same weights
    assert closures == [False] * 4
    torch.testing.assert_close(_weights(clipped), _weights(module), rtol=0, atol=0)


def _hand_gradients(batches_per_epoch: int = 4, epochs: int = 2) -> list[torch.Tensor]:
    """Plain PyTorch's gradients after each step's backward, over ``epochs`` passes of the same loader."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for _ in range(epochs):
        for x, y in DataLoader(make_dataset(16, 4, seed=0), batch_size=4):
            loss = F.mse_loss(net(x), y)
            loss.backward()
            grads.append(torch.cat([net.weight.grad.reshape(-1), net.bias.grad]).clone())
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert len(grads) == batches_per_epoch * epochs
    return grads


def test_gradients_are_zeroed_at_lightnings_moment_and_nowhere_else(make_trainer: Any) -> None:
    """zero_grad runs after the next batch's training_step, before its backward (Lightning's moment). So
    every hook after the step, the epoch's end and the code after fit see the step's gradients, and the
    next training_step still sees them too, as in Lightning."""
    seen: dict[str, list[Any]] = {"batch_end": [], "epoch_end": [], "training_step": []}

    def grads(module: Any) -> torch.Tensor | None:
        w, b = module.net.weight.grad, module.net.bias.grad
        return None if w is None else torch.cat([w.reshape(-1), b]).clone()

    class Watch(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            seen["batch_end"].append(grads(module))

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            seen["epoch_end"].append(grads(module))

    class Module(_Recorded):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen["training_step"].append(grads(self))
            return super().training_step(batch, batch_idx)

    module = Module(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    make_trainer(max_epochs=2, callbacks=[Watch()]).fit(module)
    expected = _hand_gradients()
    assert len(seen["batch_end"]) == 8 and len(seen["epoch_end"]) == 2
    for got, want in zip(seen["batch_end"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(seen["epoch_end"], (expected[3], expected[7])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grads(module), expected[-1], rtol=0, atol=0)  # kept after the fit
    assert seen["training_step"][0] is None
    for got, want in zip(seen["training_step"][1:], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_hooked_zero_grad_keeps_lightnings_moment(make_trainer: Any) -> None:
    """With a hook around zero_grad, zero_grad runs after the forward, so training_step still sees the
    previous step's gradients (Lightning's order)."""
    seen: list[bool] = []

    class Module(_Recorded):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(self.net.weight.grad is not None)
            return super().training_step(batch, batch_idx)

        def on_before_zero_grad(self, optimizer: Any) -> None:
            self.events.append("before_zero_grad")

    module = Module(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    make_trainer(max_epochs=1).fit(module)
    assert seen == [False, True, True, True]
    assert module.events == ["training_step", "before_zero_grad"] * 4
