"""polytrain's side of the matrix: one case = one uninterrupted fit, and with ``resume`` a fresh Trainer
continuing from batch ``STOP_BATCH`` of the second epoch: from the checkpoint saved after a fit stopped
there by ``max_steps`` (``fit-end``), or from the file ``ModelCheckpoint(every_n_train_steps)`` wrote there
during the uninterrupted fit (``step-checkpoint``). With ``validation`` a validation falls on that batch.

Every rank of a spawn runs every multi-rank case in turn (one process group for all of them: a spawn
per case would cost more than the cases); ``single`` cases run in the calling process.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from polytrain import Trainer
from polytrain.callbacks import ModelCheckpoint

from .cases import FACTORS, INVALID, Case
from .model import BATCHES_PER_EPOCH, CLIP, EPOCHS, GLOBAL_BATCH, SEED, SPLIT, MatrixNet

STOP_BATCH = 3  # the interruption: after this many batches of the second epoch (a window boundary)
TIMEOUT = 60.0  # a collective waiting longer than this ends the case with an error, not a hang


def strategy_spec(strategy: str) -> Any:
    return {
        "single": "single",
        "ddp": "ddp",
        "fsdp": "fsdp",
        "tensor": {"name": "model_parallel", "mode": "tensor", "tp": 2},
        "pipeline": {"name": "pipeline", "pp": 2, "split_points": [SPLIT]},
    }[strategy]


def make_trainer(case: Case, run_dir: str, **overrides: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=case.world, strategy=strategy_spec(case.strategy),
                   precision=case.precision, accumulate_grad_batches=case.accumulate,
                   gradient_clip_val=CLIP if case.clip else None, max_epochs=EPOCHS, seed=SEED,
                   use_distributed_sampler="always", logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                   val_check_interval=0.5 if case.validation == "mid-epoch" else None,
                   run_dir=run_dir, timeout=TIMEOUT, **overrides)


def _module(case: Case) -> MatrixNet:
    return MatrixNet(case.dropout, case.optimizers, GLOBAL_BATCH // case.dp, case.workers, case.impl,
                     validation=case.validation != "none")


def _state(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """The full model on global rank 0 (a collective under sharded strategies); None elsewhere."""
    state = trainer.strategy.module_state_dict()
    if not trainer.is_global_zero:
        return None
    return {k: v.detach().cpu().float().clone() for k, v in state.items()}


def run_case(case: Case, root: str) -> dict[str, Any]:
    """Fit ``case`` (and its resumed twin); rank 0 gets the final weights of each."""
    root = os.path.join(root, case.name)
    total = EPOCHS * BATCHES_PER_EPOCH // case.accumulate
    stop = (BATCHES_PER_EPOCH + STOP_BATCH) // case.accumulate
    saver = ModelCheckpoint(every_n_train_steps=stop, every_n_epochs=None, save_top_k=-1, save_last=False,
                            save_on_fit_end=False)
    trainer = make_trainer(case, os.path.join(root, "whole"),
                           callbacks=[saver] if case.resume == "step-checkpoint" else [])
    trainer.fit(_module(case))
    assert trainer.global_step == total, (case.name, trainer.global_step, total)
    out: dict[str, Any] = {"whole": _state(trainer), "resumed": None}
    if case.resume != "none":
        if case.resume == "fit-end":
            trainer = make_trainer(case, os.path.join(root, "first"), max_steps=stop)
            trainer.fit(_module(case))
            assert (trainer.current_epoch, trainer.batch_in_epoch) == (1, STOP_BATCH), case.name
            path = os.path.join(root, "mid-epoch.ckpt")
            trainer.save_checkpoint(path)
        else:
            path = os.path.join(root, "whole", "version_0", "checkpoints", f"epoch=1-step={stop}")
            path += ".ckpt" if trainer.strategy.replicated else ""
            assert os.path.exists(path), (case.name, sorted(os.listdir(os.path.dirname(path))))
        trainer = make_trainer(case, os.path.join(root, "resumed"))
        trainer.fit(_module(case), ckpt_path=path)
        assert trainer.global_step == total, (case.name, trainer.global_step, total)
        out["resumed"] = _state(trainer)
    return out


def run_cases(cases: list[Case], root: str) -> dict[str, Any]:
    """``{case name: result or traceback string}``; after a failure the remaining cases are skipped (a
    rank that raised may have left its peer inside a collective)."""
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case.name] = run_case(case, root)
        except Exception:  # noqa: BLE001 - reported by the case's test
            out[case.name] = traceback.format_exc()
            break
    return out


def probe_case(combo: tuple[tuple[str, object], ...]) -> Case:
    """The smallest case holding an invalid combination (every other factor at its first value; the
    strategy, when the combination leaves it open, ddp: the probes run in the two-rank spawn)."""
    values = {name: options[0] for name, options in FACTORS.items()}
    values["strategy"] = "ddp"
    return Case(**{**values, **dict(combo)})


def refusals(root: str) -> dict[str, str]:
    """``{combination: "ExceptionType: message"}`` of fitting each invalid combination ("" if it ran)."""
    out: dict[str, str] = {}
    for combo in INVALID:
        case = probe_case(combo)
        try:
            run_case(case, os.path.join(root, "refused"))
            out[repr(combo)] = ""
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            out[repr(combo)] = f"{type(err).__name__}: {err}"
    return out


def spawn_worker(rank: int, world_size: int, cases: list[Case], root: str) -> dict[str, Any]:
    """One rank of the matrix's spawn: every multi-rank case in turn, then the refusals."""
    import multiprocessing

    # The harness starts ranks as daemons, and a daemon may not start DataLoader workers (they watch
    # their parent and exit with it anyway); fork them, as under torchrun, not from a fresh forkserver.
    multiprocessing.current_process()._config["daemon"] = False
    multiprocessing.set_start_method("fork", force=True)
    out = run_cases(cases, root)
    out["refusals"] = refusals(root)
    return out
