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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.parallel.activation_checkpointing import apply_activation_checkpointing, resolve_checkpointing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compile_ac import SmallGPT, max_diff, state  # noqa: E402 - the blocks with dropout

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
    assert torch.equal(op_grads, plain_grads) and torch.equal(full_grads, plain_grads)  # ...with the same masks


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
