"""``single`` or ``dp`` under a launcher that started several processes stops at once.

``torchrun --nproc_per_node=2`` with ``strategy: single`` (or ``dp``) used to train two replicas that
never exchange a gradient, each on the whole dataset, and exit 0. Neither strategy can use the
other process: the job must fail before any training with an error that names the strategy, the
world size and the fix (``strategy: ddp``, or launch one process). ``strategy: auto`` picks ddp
there (proved end to end by test_launch.py; here as a unit of the launch plan).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from procs import TORCHRUN, run  # noqa: E402

from polytrain.core.errors import ConfigError  # noqa: E402
from polytrain.strategies.launcher import plan_launch  # noqa: E402
from polytrain.trainer.configuration.config import validate_trainer_config  # noqa: E402

pytestmark = pytest.mark.torch_api

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from polytrain import Trainer, TrainModule

    class Net(TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(32, 4, generator=g)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    out, strategy = sys.argv[1], sys.argv[2]
    module = Net()
    trainer = Trainer(accelerator="cpu", strategy=strategy, max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, run_dir=os.path.join(out, "run"),
                      timeout=60)
    trainer.fit(module)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"strategy": trainer.strategy.name, "world_size": trainer.world_size,
                   "weights": [float(v) for p in module.parameters() for v in p.detach().flatten()]}, fh)
''')  # noqa: E501


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_single_process_strategy_under_torchrun_fails_naming_the_fix(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", script, tmp_path, strategy], 80)
    trained = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    if trained:
        weights = [r["weights"] for r in trained.values()]
        spread = max(abs(a - b) for a, b in zip(*weights)) if len(weights) == 2 else None
        pytest.fail(f"torchrun x2 with strategy '{strategy}' trained {len(trained)} unsynchronised "
                    f"replica(s) ({[r['strategy'] for r in trained.values()]}) and exited "
                    f"{result.returncode}; the replicas' weights differ by up to {spread}")
    assert result.returncode != 0, result.describe()
    for needle in (f"'{strategy}'", "2 processes", "strategy: ddp", "one process"):
        assert needle in result.stderr, f"{needle!r} missing:\n{result.describe()}"


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int = 0, world: int = 2) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("devices", ["auto", 1, 2])
def test_launch_plan_rejects_single_process_strategies_in_a_multi_process_job(
        monkeypatch: pytest.MonkeyPatch, strategy: str, devices: object) -> None:
    _torchrun_env(monkeypatch)
    with pytest.raises(ConfigError) as err:
        plan_launch(validate_trainer_config({"accelerator": "cpu", "strategy": strategy, "devices": devices}))
    message = str(err.value)
    assert f"'{strategy}'" in message and "2 processes" in message and "strategy: ddp" in message, message


def test_launch_plan_auto_is_ddp_in_a_multi_process_job(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, rank=1)
    plan = plan_launch(validate_trainer_config({"accelerator": "cpu", "strategy": "auto"}))
    assert (plan.strategy_name, plan.method, plan.world_size) == ("ddp", "here", 2)


def test_launch_plan_single_in_a_one_process_job_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, world=1)
    plan = plan_launch(validate_trainer_config({"accelerator": "cpu", "strategy": "single"}))
    assert (plan.strategy_name, plan.method) == ("single", "here")
