"""``activation_checkpointing: {mode: op}``: a checkpointed block keeps its odd-numbered matmul outputs and
its attention output, and recomputes the rest in backward (``OpSelection``).

What runs in backward is counted with a dispatch mode: the recompute is the difference from a run without
checkpointing. Gradients equal a run without checkpointing exactly, dropout included (the RNG state is
restored for the recompute, as for full checkpointing).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.parallel.activation_checkpointing import apply_activation_checkpointing, resolve_checkpointing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compile_ac import SmallGPT, max_diff, state  # noqa: E402 - the blocks with dropout

pytestmark = pytest.mark.torch_api

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"  # the forward kernel on CPU


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str | None) -> tuple[Counter[str], Counter[str], torch.Tensor]:
    torch.manual_seed(0)
    gpt = SmallGPT(dropout=0.2)
    if mode is not None:
        apply_activation_checkpointing(gpt, resolve_checkpointing({"mode": mode}))
    x = torch.randint(0, 20, (4, 16))
    torch.manual_seed(1)
    forward, backward = OpCounter(), OpCounter()
    with forward:
        loss = gpt.net(x).float().pow(2).mean()
    with backward:
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in gpt.parameters()])
    return forward.calls, backward.calls, grads


def test_op_mode_recomputes_every_other_matmul_and_no_attention() -> None:
    fwd, plain, plain_grads = _backward_ops(None)
    _, full, full_grads = _backward_ops("full")
    _, op, op_grads = _backward_ops("op")
    blocks_matmuls = 8  # 2 blocks x (qkv, proj, fc, fc2); the head's matmul is outside the blocks
    assert fwd["aten.addmm.default"] == blocks_matmuls + 1 and fwd[SDPA] == 2
    assert plain["aten.addmm.default"] == 0 and plain[SDPA] == 0  # no recompute
    assert full["aten.addmm.default"] == blocks_matmuls and full[SDPA] == 2  # the whole blocks again
    assert op["aten.addmm.default"] == blocks_matmuls // 2 and op[SDPA] == 0  # proj and fc2 only
    assert op["aten.bernoulli_.float"] == full["aten.bernoulli_.float"] == 4  # dropout recomputed...
    assert (torch.equal(op_grads, plain_grads)
            and torch.equal(full_grads, plain_grads))  # ...with the same masks


def test_op_mode_through_the_trainer_equals_no_checkpointing(run_dir: str) -> None:
    from test_compile_ac import fit

    _, plain = fit(dropout=0.2, run_dir=run_dir)
    module, op = fit(dropout=0.2, run_dir=run_dir, activation_checkpointing={"mode": "op"})
    assert max_diff(state(plain), state(op)) == 0.0
    assert all(hasattr(type(b), "_polytrain_checkpointed_from") for b in (module.net[1], module.net[2]))


def test_op_mode_under_compile_equals_eager(run_dir: str) -> None:
    """Compiled (``aot_eager``: dynamo and AOTAutograd trace the selective-checkpoint policy into the graph)
    per-op checkpointed blocks train as eager ones without checkpointing; no graph break."""
    import torch._dynamo.utils as dynamo_utils
    from test_compile_ac import COMPILE_TOL, fit

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    _, eager = fit(run_dir=run_dir)
    _, both = fit(run_dir=run_dir, compile={"backend": "aot_eager", "modules": ["DropBlock"]},
                  activation_checkpointing={"mode": "op"})
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1
    assert max_diff(state(eager), state(both)) <= COMPILE_TOL["atol"]


# --------------------------------------------------------------------------- models nobody here wrote


def _trained_once(build: Any, batch: tuple[torch.Tensor, ...], loss: Any, mode: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = build()
    if mode is not None:
        apply_activation_checkpointing(model, resolve_checkpointing({"mode": mode}))
    model.train()
    loss(model, *batch).backward()
    return model


@pytest.mark.parametrize("mode", ["full", "op"])
def test_a_checkpointed_hugging_face_model_recomputes_without_its_key_value_cache(mode: str) -> None:
    """GPT-2 caches keys and values in forward by default; recomputed, a block would see them twice and
    torch would stop the backward. Checkpointing turns the cache off: gradients equal no checkpointing."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, labels=x).loss

    plain = _trained_once(lambda: transformers.GPT2LMHeadModel(config), (tokens,), loss, None)
    checkpointed = _trained_once(lambda: transformers.GPT2LMHeadModel(config), (tokens,), loss, mode)
    assert checkpointed.config.use_cache is False
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["full", "op"])
def test_a_recomputed_batchnorm_updates_its_running_statistics_once(mode: str) -> None:
    """A BatchNorm in a checkpointed block runs twice a step (forward, recomputation); its running
    statistics move once, as without checkpointing."""
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))

    def build() -> nn.Module:
        block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        return nn.Sequential(nn.Sequential(block, nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))),
                             nn.Flatten(), nn.Linear(64, 2))

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    plain = _trained_once(build, (images,), loss, None)
    checkpointed = _trained_once(build, (images,), loss, mode)
    assert [n for n, _ in checkpointed.named_buffers()] == [n for n, _ in plain.named_buffers()]
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert int(checkpointed.get_buffer("0.0.1.num_batches_tracked")) == 1
