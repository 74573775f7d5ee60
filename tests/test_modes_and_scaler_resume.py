"""Single-process behaviours a broken loop would get silently wrong: module modes and autograd around
a mid-epoch validation, ``dp`` on CPU (one device: plain training, said out loud), ``launcher: none``,
and the GradScaler's scale and growth tracker surviving a resume."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule
from torch import nn
from torch.utils.data import DataLoader

from polytrain import Trainer
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.torch_api

# --------------------------------------------------------------------------- modes around validation


class ModeProbe(TinyModule):
    """Records (module.training, dropout child.training, grad enabled) in every step."""

    def __init__(self) -> None:
        super().__init__(n=16, batch_size=4, val_n=8)
        self.drop = nn.Dropout(0.0)  # p=0: the arithmetic is TinyModule's; only its mode is observed
        self.seen: list[tuple[str, int, bool, bool, bool]] = []

    def _record(self, kind: str, batch_idx: int) -> None:
        self.seen.append((kind, batch_idx, self.training, self.drop.training, torch.is_grad_enabled()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("train", batch_idx)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("val", batch_idx)
        return super().validation_step(batch, batch_idx)


def test_validation_runs_in_eval_mode_without_grad_and_training_resumes_in_train_mode(
        make_trainer: Any) -> None:
    module = ModeProbe()
    make_trainer(max_epochs=1, val_check_interval=2).fit(module)  # 4 batches: validation after 2 and 4
    kinds = [(k, i) for k, i, *_ in module.seen]
    assert kinds == [("train", 0), ("train", 1), ("val", 0), ("val", 1), ("train", 2), ("train", 3),
                     ("val", 0), ("val", 1)]
    for kind, idx, training, child_training, grad in module.seen:
        expected = (True, True, True) if kind == "train" else (False, False, False)
        assert (training, child_training, grad) == expected, (
            f"{kind} batch {idx}: {(training, child_training, grad)}")
    assert module.training and module.drop.training  # fit returns the module in train mode


# --------------------------------------------------------------------------- dp on CPU


def test_dp_on_cpu_warns_and_trains_exactly_like_a_plain_loop(make_trainer: Any) -> None:
    torch.manual_seed(0)
    reference = TinyModule(n=16, batch_size=4, val_n=None)
    torch.manual_seed(0)
    module = TinyModule(n=16, batch_size=4, val_n=None)
    with pytest.warns(UserWarning, match="strategy 'dp' on CPU.*single-device.*Use strategy 'ddp'"):
        trainer = make_trainer(strategy="dp", max_epochs=2)
        trainer.fit(module)
    assert not isinstance(trainer.strategy.model, nn.DataParallel)
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    for _ in range(2):
        for x, y in DataLoader(reference.train_ds, batch_size=4):
            opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            opt.step()
    for (name, ours), theirs in zip(module.state_dict().items(), reference.state_dict().values(),
                                    strict=True):
        assert torch.equal(ours, theirs), name
    assert trainer.global_step == 8


# --------------------------------------------------------------------------- launcher: none


def test_launcher_none_runs_one_process_here_and_refuses_to_start_more(monkeypatch: Any) -> None:
    from polytrain.strategies.launcher import plan_launch
    from polytrain.trainer.configuration.config import validate_trainer_config

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    one = plan_launch(validate_trainer_config({"accelerator": "cpu", "devices": 1, "launcher": "none"}))
    assert one.method == "here"
    with pytest.raises(ConfigError, match=r"needs 2 processes but trainer.launcher='none'.*torchrun "
                                          r"--nproc_per_node=2"):
        plan_launch(validate_trainer_config({"accelerator": "cpu", "devices": 2, "strategy": "ddp",
                                             "launcher": "none"}))


# --------------------------------------------------------------------------- GradScaler on resume


class ScalerProbe(TinyModule):
    """16-mixed: the first steps' fp16 gradients overflow at the initial scale 65536, so the scaler
    skips three of them (scale 8192 after step 4) and its growth tracker then counts clean steps:
    after step 6 it holds (8192, 2), not a fresh GradScaler's (65536, 0) in either field."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=4, val_n=None, lr=0.05)
        self.at_start: tuple[float, int] | None = None

    def _state(self) -> tuple[float, int]:
        scaler = self.trainer.strategy.precision.scaler
        return float(scaler.get_scale()), int(scaler._get_growth_tracker())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.at_start is None:
            self.at_start = self._state()  # before this process's first step: what the resume loaded

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _scaler_fit(kwargs: dict[str, Any], steps: int, **extra: Any) -> tuple[ScalerProbe, Trainer]:
    torch.manual_seed(0)
    module = ScalerProbe()
    trainer = Trainer(**{**kwargs, "precision": "16-mixed", "max_steps": steps, "enable_checkpointing": True})
    trainer.fit(module, **extra)
    return module, trainer


def test_grad_scaler_scale_and_growth_tracker_are_restored_on_resume(quiet_kwargs: dict[str, Any],
                                                                     tmp_path: Any) -> None:
    whole, _ = _scaler_fit({**quiet_kwargs, "run_dir": str(tmp_path / "whole")}, 10)
    first, _ = _scaler_fit(quiet_kwargs, 6)
    saved = first._state()
    assert saved == (8192.0, 2)
    assert torch.load(os.path.join(quiet_kwargs["run_dir"], "version_0", "checkpoints", "last.ckpt"),
                      weights_only=True)["loop"]["global_step"] == 6
    resumed, resumed_trainer = _scaler_fit(quiet_kwargs, 10, ckpt_path="last")
    assert resumed.at_start == saved, f"resumed with scaler state {resumed.at_start}, saved {saved}"
    assert resumed_trainer.global_step == 10
    assert resumed._state() == whole._state() == (8192.0, 6)
    for (name, ours), theirs in zip(resumed.state_dict().items(), whole.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
