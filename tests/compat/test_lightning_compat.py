"""Lightning compatibility: the modules in ``modules.py`` run under PyTorch Lightning and under polytrain
with only their framework import changed, and give the same hook calls (with the global RNG's state at
every one of them, on one process), losses and weights, bitwise, on one process and on ddp x2.

Lightning-only tests pin the reference behaviour and the harness. ``lightning`` is a dev-only
dependency: polytrain never imports it (tests/test_import_graph.py would not see it, so
``test_polytrain_never_imports_lightning`` checks the modules loaded).

One documented difference: on resume polytrain restores model and optimizer together after
``configure_optimizers`` and restores the RNG, where Lightning loads the weights before it and restores
no RNG, so the resume case compares the hook calls up to the resume, and the results after it.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from compat import harness  # noqa: E402 - after the skip on purpose
from compat.harness import comparable, first_difference, run_case, run_case_distributed  # noqa: E402

pytestmark = pytest.mark.own_logic

# id -> (case, case keywords, Trainer keywords on top of harness.DEFAULT_TRAINER, stages)
ONE_PROCESS = {
    # Dropout draws from the global RNG in every step: one process must reproduce Lightning's stream.
    "boring-acc1": ("boring", dict(hooked=True, n_train=36, dropout=0.5), dict(gradient_clip_val=0.5),
                    ["fit", "validate", "test", "predict"]),
    "boring-acc2": ("boring", dict(hooked=True, n_train=36, dropout=0.5),
                    dict(accumulate_grad_batches=2, gradient_clip_val=0.5), ["fit"]),
    "boring-plain": ("boring", dict(n_train=36, dropout=0.5), {}, ["fit"]),
    "boring-resume": ("boring", dict(hooked=True, n_train=8), dict(max_epochs=1, enable_checkpointing=True),
                      ["fit", "save_checkpoint",
                       ("fit", {"trainer": {"max_epochs": 2, "enable_checkpointing": True},
                                "ckpt_path": "{root}/saved.ckpt"})]),
    "transformer": ("transformer", dict(dropout=0.1), dict(accumulate_grad_batches=2), ["fit", "test"]),
    "autoencoder": ("autoencoder", {}, {}, ["fit", "test", "predict"]),
    "gan": ("gan", dict(n_train=128), {}, ["fit"]),
}

# Under DDP polytrain gives each data-parallel rank its own RNG stream and Lightning does not, so these
# cases draw nothing from the global RNG inside training steps (dropout 0, the GAN's own generator).
DDP = {
    "boring": ("boring", dict(n_train=36, n_val=16, dropout=0.0), {}, ["fit"]),
    "transformer": ("transformer", dict(dropout=0.0), {}, ["fit"]),
    "autoencoder": ("autoencoder", {}, dict(max_epochs=1), ["fit"]),
    "gan": ("gan", dict(n_train=128), {}, ["fit"]),
}


def _run(framework: str, spec: tuple, **kwargs) -> harness.RunResult:
    case, case_kwargs, trainer_kwargs, stages = spec
    return run_case(framework, case, case_kwargs=case_kwargs, trainer_kwargs=trainer_kwargs, stages=stages,
                    **kwargs)


def _run_ddp(framework: str, spec: tuple) -> list[harness.RunResult]:
    case, case_kwargs, trainer_kwargs, stages = spec
    return run_case_distributed(framework, case, 2, case_kwargs=case_kwargs, trainer_kwargs=trainer_kwargs,
                                stages=stages, timeout=300)


def _flat_losses(result: harness.RunResult) -> list[torch.Tensor]:
    out = []
    for loss in result.losses:
        if isinstance(loss, dict):
            out.extend(v for _, v in sorted(loss.items()) if isinstance(v, torch.Tensor))
        elif isinstance(loss, torch.Tensor):
            out.append(loss)
    return out


def assert_same_run(a: harness.RunResult, b: harness.RunResult, rng: bool = True) -> None:
    diff = first_difference(comparable(a.events, rng=rng), comparable(b.events, rng=rng))
    assert diff is None, f"hook sequences differ ({a.framework} vs {b.framework}): {diff}"
    la, lb = _flat_losses(a), _flat_losses(b)
    assert len(la) == len(lb), f"{len(la)} vs {len(lb)} losses"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert torch.equal(x, y), f"loss {i} differs: {x.item()!r} vs {y.item()!r}"
    assert a.state_dict.keys() == b.state_dict.keys()
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), f"weight {k} differs"
    assert (a.global_step, a.current_epoch) == (b.global_step, b.current_epoch)


# ------------------------------------------------------------------------------------------ Lightning only


def test_modules_differ_only_in_the_framework_line() -> None:
    lightning, polytrain = (harness.module_source(f).splitlines() for f in ("lightning", "polytrain"))
    assert len(lightning) == len(polytrain)
    differing = [(a, b) for a, b in zip(lightning, polytrain) if a != b]
    assert differing == [(harness.FRAMEWORK_LINES["lightning"], harness.FRAMEWORK_LINES["polytrain"])]


@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_lightning_reference_is_deterministic(name: str) -> None:
    """Two Lightning runs of a case agree exactly: a parity failure is never the reference's noise."""
    first, second = _run("lightning", ONE_PROCESS[name]), _run("lightning", ONE_PROCESS[name])
    assert all(math.isfinite(float(v)) for v in _flat_losses(first))
    assert_same_run(first, second)


def test_lightning_one_process_equals_a_plain_loop() -> None:
    """Lightning's 1-process fit draws from the global RNG exactly where a plain loop does (its sanity
    check runs under isolate_rng), so with dropout and shuffling the two agree bitwise."""
    spec = ("boring", dict(n_train=36, dropout=0.5), dict(gradient_clip_val=0.5, accumulate_grad_batches=2),
            ["fit"])
    ref = _run("lightning", spec)
    ns = harness.load_modules("lightning")
    ns.pl.seed_everything(0, verbose=False)
    model = ns.BoringModel(n_train=36, dropout=0.5)
    [opt], [sched] = model.configure_optimizers()
    train, val = model.train_dataloader(), model.val_dataloader()
    losses = []
    for _ in range(2):
        model.train()
        for i, batch in enumerate(train):
            loss = model.training_step(batch, i)
            losses.append(loss.detach())
            (loss / 2).backward()
            if (i + 1) % 2 == 0 or i + 1 == len(train):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for i, batch in enumerate(val):
                model.validation_step(batch, i)
        sched.step()
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, losses)) and len(ref.losses) == len(losses)
    assert all(torch.equal(ref.state_dict[k], v) for k, v in model.state_dict().items())


@pytest.mark.distributed
def test_lightning_ddp_runs_inside_our_processes() -> None:
    """With LOCAL_RANK (and friends) set by our launcher, Lightning joins the process group instead of
    re-launching the script; it injects DistributedSampler(shuffle=True, seed=0, drop_last=False)."""
    ranks = _run_ddp("lightning", DDP["boring"])
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        assert r.extra["train_sampler"] == {"class": "DistributedSampler", "num_replicas": 2, "rank": r.rank,
                                            "shuffle": True, "seed": 0, "drop_last": False, "epoch": 1,
                                            "batch_size": 4, "loader_drop_last": False}
        assert r.global_step == 2 * 5  # ceil(36 / 2 / 4) steps per epoch
    for k in ranks[0].state_dict:
        assert torch.equal(ranks[0].state_dict[k], ranks[1].state_dict[k])


# ------------------------------------------------------------------------------------------ parity


def _until_resume(result: harness.RunResult) -> harness.RunResult:
    fits = [i for i, e in enumerate(result.events) if e["who"] == "harness" and e["hook"] == "stage:fit"]
    return dataclasses.replace(result, events=result.events[:fits[1]])


@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_one_process_parity(name: str) -> None:
    lightning, polytrain = _run("lightning", ONE_PROCESS[name]), _run("polytrain", ONE_PROCESS[name])
    if name == "boring-resume":  # hooks up to the resume; losses, weights and step counts to the end
        assert_same_run(_until_resume(lightning), _until_resume(polytrain), rng=True)
        lightning.events, polytrain.events = [], []
    assert_same_run(lightning, polytrain, rng=True)
    assert polytrain.metrics["callback_metrics"] == lightning.metrics["callback_metrics"]
    if "images" in lightning.extra:
        assert all(torch.equal(a, b) for a, b in zip(lightning.extra["images"], polytrain.extra["images"]))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(DDP))
def test_ddp_parity(name: str) -> None:
    lightning, polytrain = _run_ddp("lightning", DDP[name]), _run_ddp("polytrain", DDP[name])
    for a, b in zip(lightning, polytrain):
        assert_same_run(a, b, rng=False)


# Logs per step, per epoch from the steps, and inside the epoch-end hooks (which read them back); every
# value is synced, so ranks agree under both frameworks (Lightning leaves unsynced values per rank).
EPOCH_METRICS = ("epoch_metrics", dict(n_train=24, n_val=12), dict(max_epochs=2), ["fit", "validate", "test"])


def _assert_same_epoch_end_metrics(a: harness.RunResult, b: harness.RunResult) -> None:
    seen_a, seen_b = harness.epoch_end_metrics(a.events), harness.epoch_end_metrics(b.events)
    assert len(seen_a) >= 10, seen_a  # sanity check, 2 epochs of validation and training, validate, test
    diff = first_difference(seen_a, seen_b)
    assert diff is None, ("callback_metrics inside the epoch-end hooks differ "
                          f"({a.framework} vs {b.framework}): {diff}")
    assert a.extra["seen_in_hooks"] == b.extra["seen_in_hooks"]


def test_callback_metrics_inside_every_epoch_end_hook_match_lightning() -> None:
    """Hook by hook (the recording callback's at entry, the module's at exit): this epoch's reduced values,
    what the hook itself logged (read back inside it), the sanity check's values during it only."""
    lightning, polytrain = _run("lightning", EPOCH_METRICS), _run("polytrain", EPOCH_METRICS)
    _assert_same_epoch_end_metrics(lightning, polytrain)
    assert [v for _, v in polytrain.extra["seen_in_hooks"]] == [10.0, 10.0, 10.0, 20.0, 20.0, 30.0]


@pytest.mark.distributed
def test_callback_metrics_inside_every_epoch_end_hook_match_lightning_under_ddp() -> None:
    lightning, polytrain = _run_ddp("lightning", EPOCH_METRICS), _run_ddp("polytrain", EPOCH_METRICS)
    for a, b in zip(lightning, polytrain):
        _assert_same_epoch_end_metrics(a, b)


def test_polytrain_never_imports_lightning() -> None:
    """Running polytrain's side loads no Lightning module of its own accord (the harness imports it
    for the reference runs, so check in a fresh interpreter)."""
    import subprocess

    tests_dir = str(harness.MODULES_FILE.parents[1])
    code = (f"import sys; sys.path.insert(0, {tests_dir!r}); from compat.harness import run_case; "
            "run_case('polytrain', 'boring'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric')); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
