"""Requirement 9: resharding resume. A sharded (fsdp) checkpoint taken mid-epoch at world size 2
resumes at world size 1 and, from there, back at 2:

- model and optimizer state after each load equal, exactly, the state at the end of the run that
  wrote the checkpoint;
- the data position is re-split over the new data-parallel ranks: a checkpoint records the global
  sample offset within the epoch (``loop.sample_offset``), and ``ResumableDistributedSampler``
  continues the same epoch permutation from it. Across the three runs every sample of the epoch
  is consumed, none twice beyond ``DistributedSampler``'s padding.

27 samples, batch 2 per rank: run A (2 ranks) stops after 3 steps (12 samples), run B (1 rank)
takes 4 steps (8 samples), run C (2 ranks) finishes the epoch (7 samples + 1 padding).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch.utils.data import DataLoader, DistributedSampler

from .helpers import figure, rel_module, samples

pytestmark = [pytest.mark.torch_api, pytest.mark.reliability, pytest.mark.distributed]

N, BATCH = 27, 2


def _full_state(trainer: Any) -> dict[str, torch.Tensor]:
    from polytrain.checkpoint.state import full_optimizer_state

    state = {f"model.{k}": v.detach().clone() for k, v in trainer.strategy.module_state_dict().items()}
    optim = full_optimizer_state(trainer.strategy.state_parts())  # a collective under fsdp
    state.update({f"optimizer.{k}": v.detach().clone() if isinstance(v, torch.Tensor) else v
                  for k, v in optim.items()})
    return state


def _worker(rank: int, world_size: int, root: str, phase: str, ckpt_path: str | None, max_steps: int) -> dict:
    from polytrain import Trainer
    from polytrain.callbacks.base import Callback
    from polytrain.checkpoint.layout import find_resumable

    class AfterLoad(Callback):
        state: dict[str, torch.Tensor] | None = None

        def on_fit_start(self, trainer: Any, module: Any) -> None:  # right after the checkpoint was loaded
            self.state = _full_state(trainer)

    out_dir = os.path.join(root, phase)
    after_load = AfterLoad()
    module = rel_module().RelModule(n=N, batch_size=BATCH, out_dir=out_dir)
    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=world_size, max_epochs=1,
                      max_steps=max_steps, seed=0,
                      run_dir=os.path.join(out_dir, "run"), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, timeout=60.0, callbacks=[after_load])
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"loaded": after_load.state if ckpt_path else None, "final": _full_state(trainer),
            "global_step": trainer.global_step,
            "checkpoint": find_resumable(os.path.join(out_dir, "run", "version_0", "checkpoints"))}


@pytest.mark.timeout(900)
def test_fsdp_checkpoint_resumes_at_other_world_sizes_exactly(tmp_path: Any) -> None:
    root = str(tmp_path)
    a = run_distributed(_worker, 2, root, "A", None, 3, timeout=300.0)
    b = run_distributed(_worker, 1, root, "B", a[0]["checkpoint"], 7, timeout=300.0)
    c = run_distributed(_worker, 2, root, "C", b[0]["checkpoint"], -1, timeout=300.0)

    def same(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(
            torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)

    exact_b = same(b[0]["loaded"], a[0]["final"])
    # The full model state is gathered on rank 0 only; the optimizer's on every rank.
    optim_only = {k: v for k, v in b[0]["final"].items() if k.startswith("optimizer.")}
    exact_c = same(c[0]["loaded"], b[0]["final"]) and same(c[1]["loaded"], optim_only)
    # sharded (DCP) checkpoints
    assert os.path.isdir(a[0]["checkpoint"]) and os.path.isdir(b[0]["checkpoint"])
    meta = torch.load(os.path.join(b[0]["checkpoint"], "meta.pt"), weights_only=True)
    assert meta["loop"]["dp_size"] == 1 and meta["loop"]["sample_offset"] == 20

    consumed = []
    for phase, ranks in (("A", 2), ("B", 1), ("C", 2)):
        for rank in range(ranks):
            consumed += [i for rec in samples(os.path.join(root, phase), rank) if rec["epoch"] == 0
                         for i in rec["indices"]]
    expected = set()
    for rank in range(2):  # what an uninterrupted 2-rank epoch consumes
        sampler = DistributedSampler(rel_module().IndexedRegression(N), num_replicas=2, rank=rank,
                                     shuffle=True, seed=0)
        sampler.set_epoch(0)
        expected |= set(sampler)
    padding = (-(N - 20)) % 2  # C re-split the last 7 samples over 2 ranks: one padding copy
    duplicates = len(consumed) - len(set(consumed))
    figure("resharding resume fsdp 2 -> 1 -> 2",
           f"model+optimizer exact after load: 2->1 {exact_b}, 1->2 {exact_c}; "
           f"epoch samples covered {len(set(consumed))}/{N}, duplicates "
           f"{duplicates} (padding allows {padding})")
    assert exact_b and exact_c
    assert (any(k.startswith("model.") for k in a[0]["final"])
            and any(k.startswith("optimizer.") for k in a[0]["final"]))
    assert set(consumed) == expected == set(range(N))
    assert duplicates <= padding
    assert [r["global_step"] for r in c] == [9, 9]


@pytest.mark.timeout(120)
def test_resplit_covers_the_epoch_for_any_sizes() -> None:
    """The sampler arithmetic alone, over many sizes: positions consumed at one data-parallel size
    plus the re-split rest at another always cover the epoch's permutation exactly once (+ padding)."""
    from polytrain.data.samplers import ResumableDistributedSampler

    checked = 0
    for n in (7, 16, 27, 33):
        ds = list(range(n))
        for old_dp in (1, 2, 3, 4):
            for new_dp in (1, 2, 3, 4):
                for batches_done in range(0, -(-n // old_dp) // 2 + 2):
                    old = [ResumableDistributedSampler(ds, num_replicas=old_dp, rank=r, shuffle=True, seed=5)
                           for r in range(old_dp)]
                    for s in old:
                        s.set_epoch(3)
                    first = [i for s in old for i in list(s)[: batches_done * 2]]
                    offset = len(first)  # interleaved: ranks consumed the permutation's first positions
                    new = [ResumableDistributedSampler(ds, num_replicas=new_dp, rank=r, shuffle=True, seed=5)
                           for r in range(new_dp)]
                    shares = []
                    for s in new:
                        s.set_epoch(3)
                        s.resume_from(offset)
                        shares.append(list(s))
                    assert len({len(share) for share in shares}) == 1  # every new rank takes as many steps
                    rest = [i for share in shares for i in share]
                    # padding: the old split's (if its consumed positions ran past n), the new split's rest
                    allowed_dups = max(0, offset - n) + (-max(0, n - offset)) % new_dp
                    assert set(first + rest) == set(ds), (n, old_dp, new_dp, batches_done)
                    assert len(first + rest) - n <= allowed_dups, (n, old_dp, new_dp, batches_done)
                    checked += 1
    figure("re-split arithmetic", f"{checked} (size, old dp, new dp, position) cases cover the epoch exactly")


@pytest.mark.timeout(120)
def test_position_that_cannot_be_resplit_is_an_error_not_drift() -> None:
    from polytrain.core.errors import SamplerError
    from polytrain.data.loaders import resume_position

    ds = rel_module().IndexedRegression(20)
    user_loader = DataLoader(ds, batch_size=2, sampler=list(range(0, 20, 2)))  # the user's own sharding
    with pytest.raises(SamplerError, match="cannot be re-split"):
        resume_position(user_loader, 3, 5, 1, {"sample_offset": 12, "dp_size": 2})
    start, skip, _ = resume_position(user_loader, 3, 5, 2, {"sample_offset": 12, "dp_size": 2})
    assert (start, skip) == (3, 3)  # same size: the loop skips the consumed batches itself
    figure("position that cannot be re-split", "SamplerError (no silent drift)")
