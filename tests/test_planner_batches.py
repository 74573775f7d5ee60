"""The planner takes any module ``fit`` trains: any batch structure the loop accepts (tensor, tuple, list,
dict, dataclass, Hugging Face ``BatchEncoding``), a step that logs and reads ``self.trainer``, a model built
in ``configure_model`` or held as one attribute, manual optimisation; every example in ``examples/`` plans.
``polytrain plan`` runs in this process (``polytrain.cli.main``), as the command line runs it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polytrain import Trainer
from polytrain.cli import main
from polytrain.core.errors import ConfigError

pytestmark = pytest.mark.own_logic

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from batch_kinds_module import KINDS, BatchKindsLM  # noqa: E402

# Each example's training config (one with a module:) as `polytrain plan` reads it, with what makes it run
# offline here
CONFIGS = [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("examples/*/config*.yaml"))]
EXAMPLES = {c: [] for c in CONFIGS if "\nmodule:" in "\n" + (ROOT / c).read_text()}
EXAMPLES["examples/cifar10/config.yaml"] = ["module.fake=true", "module.fake_size=64", "module.batch_size=32",
                                          "module.num_workers=0"]


def _plan_cli(capsys: pytest.CaptureFixture[str], config: str, *overrides: str) -> str:
    code = main(["plan", "-c", config, "--nodes", "1", "--devices-per-node", "4", "--hardware", "cpu",
                 *overrides])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    return out.out


def _config(tmp_path: Path, **module: Any) -> str:
    lines = ["module:", "  _target_: batch_kinds_module.BatchKindsLM",
             *(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in module.items()),
             "trainer:", "  accelerator: cpu", "  devices: 4", "  max_epochs: 1", "  strategy: {name: fsdp}"]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_examples_planned_are_every_training_config() -> None:
    assert sorted(set(CONFIGS) - set(EXAMPLES)) == ["examples/collectives/config.yaml"]  # demo.py's settings
    assert len(EXAMPLES) >= 11


@pytest.mark.parametrize("config", sorted(EXAMPLES))
def test_every_example_plans(config: str, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    out = _plan_cli(capsys, config, *EXAMPLES[config])
    assert "\nbest: " in out, out


def test_a_gan_driving_its_optimizers_plans_without_a_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Manual optimisation: ``self.optimizers()``, ``toggle_optimizer``, two ``manual_backward`` calls and
    clipping by hand run in the trace, and both halves' losses are the one whose backward is costed; no
    pipeline is ranked (the pipeline strategy refuses a step that drives its optimizers), in its words."""
    from polytrain.parallel.planner import Training, hardware, rank_layouts
    from polytrain.trainer.configuration.config import instantiate, load_config
    from polytrain.trainer.launch.planned import first_batch, step_profiler
    from polytrain.trainer.launch.traced_step import traced_training_step

    monkeypatch.chdir(ROOT)
    config = load_config("examples/gan/config.yaml", [])
    with torch.device("meta"):
        gan = instantiate(config["module"], "module", config.get("config_dir"))
    gan._attach(Trainer.from_config(config))
    batch = first_batch(gan.train_dataloader())
    halves = traced_training_step(gan, [batch[0][:1].to("meta")], gan.trainer)
    # the generator's loss + the discriminator's: a backward reaches both networks' weights
    weights = [gan.generator.net[0].weight, gan.discriminator.net[1].weight]
    assert halves.grad_fn.name() == "AddBackward0"
    assert all(g is not None for g in torch.autograd.grad(halves, weights, allow_unused=True))
    plan = rank_layouts(hardware("cpu", 1, 4), Training(global_batch=64, optimizer="adam"),
                        step_profiler(gan, batch, "cpu", None, "32", "cpu"))
    assert plan.ranked and all(e.layout.pp == 1 for e in plan.ranked)
    piped = [r.reason for r in plan.rejected if r.layout.pp > 1 and "micro-batches" not in r.reason]
    assert piped and all(r.startswith("manual optimisation (training_step driving the optimizers) is not "
                                      "supported under pipeline parallelism") for r in piped), piped


@pytest.mark.parametrize("kind", KINDS)
def test_polytrain_plan_takes_every_batch_structure(kind: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The step runs on the batch as the loader made it: a bare token tensor (once handed ``[x]``), a dict,
    a dataclass, a ``BatchEncoding``; it logs and reads ``self.trainer`` (once refused: "nothing can be
    logged there")."""
    out = _plan_cli(capsys, _config(tmp_path, batch_kind=kind))
    assert out.startswith("plan for BatchKindsLM") and "global batch 32" in out  # 8 a loader x 4 ranks
    assert "\nbest: " in out


def _profile(kind: str, arch: str = "gpt2", configure_model: bool = False, tp: int = 1) -> Any:
    from polytrain.trainer.launch.planned import as_built, first_batch, step_profiler

    with torch.device("meta"):
        module = BatchKindsLM(batch_kind=kind, arch=arch, configure_model=configure_model)
    module._attach(Trainer(accelerator="cpu", max_epochs=1, logger=False))
    batch = first_batch(module.train_dataloader())
    return step_profiler(as_built(module), batch, "cpu", None, "32", "cpu")(tp)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "tuple"])
def test_the_profile_is_the_same_whatever_holds_the_tokens(kind: str) -> None:
    """The same tokens through the same model cost the same, each structure as the (inputs, targets) tuple:
    every block's parameters, saved activations, FLOPs and backward peak, and the batch's bytes."""
    reference = _profile("tuple")
    profile = _profile(kind)
    assert len(profile.children) == len(reference.children) == 4  # before, 2 blocks, after
    assert profile.seq_len == reference.seq_len == 16
    for got, want in zip(profile.children, reference.children):
        assert got.saved_bytes == want.saved_bytes and got.flops == want.flops
        assert got.params == want.params and got.backward_bytes == want.backward_bytes
    assert all(sum(getattr(c, term) for c in profile.children) > 0
               for term in ("saved_bytes", "flops", "params", "backward_bytes"))
    inputs = {"tensor": 1}.get(kind, 2) * 16 * 8  # one sample's int64 tokens (and labels)
    assert profile.children[0].input_bytes == inputs


def test_a_model_built_in_configure_model_plans_split_by_its_own_plan() -> None:
    """Llama built by ``configure_model`` (on meta, as a fit builds it), fed a ``BatchEncoding``: profiled
    block by block at tp 1 and split by its own tensor-parallel plan at tp 2 (every weight of a block split,
    its FLOPs and largest weight halved, as one rank runs and holds them)."""
    whole = _profile("batch_encoding", "llama", configure_model=True)
    split = _profile("batch_encoding", "llama", configure_model=True, tp=2)
    assert whole.children[1].params == sum(p.numel() for p in BatchKindsLM(arch="llama").model.model.layers[0]
                                           .parameters())
    block, half = whole.children[1], split.children[1]
    assert half.tp_params == block.tp_params == 9216  # q, k, v, o, gate, up, down: all but the two norms
    assert half.flops * 2 == block.flops > 0 and half.largest_param * 2 == block.largest_param


def test_plan_true_plans_from_a_dict_batch() -> None:
    """``strategy: {name: parallel, plan: true}``: what ``Trainer.fit`` runs before any worker starts, on a
    module whose loader yields dicts and whose step logs and reads its trainer."""
    from polytrain.trainer.launch.planned import plan_layout

    trainer = Trainer(accelerator="cpu", strategy={"name": "parallel", "plan": True}, logger=False,
                      max_epochs=1)
    launch = SimpleNamespace(world_size=4, num_nodes=1, accelerator="cpu", env=SimpleNamespace(global_rank=1))
    module = BatchKindsLM(batch_kind="dict")
    module._attach(trainer)  # as Trainer.fit attaches it before planning
    assert plan_layout(trainer.run_sources(), None, launch, module, module.train_dataloader(), None, "fit",
                       None)
    chosen = trainer.config.strategy["chosen"]
    assert chosen["dp_replicate"] * chosen["dp_shard"] * chosen["tp"] * chosen["pp"] == 4


class _SkipsEveryBatch(BatchKindsLM):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None


def test_a_step_that_returns_no_loss_is_refused_in_words(tmp_path: Path) -> None:
    from polytrain.trainer.launch.planned import first_batch, step_profiler

    with torch.device("meta"):
        module = _SkipsEveryBatch()
    with pytest.raises(ConfigError, match=r"_SkipsEveryBatch.training_step returned no loss on the planner's "
                                          r"batch .* Return the loss, or pin the degrees"):
        step_profiler(module, first_batch(module.train_dataloader()), "cpu", None, "32", "cpu")(1)


def test_the_fit_attaches_the_module_before_it_plans(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``Trainer.fit`` with plan: true on one process: the step the planner traces reads ``self.trainer``
    (the fit's own, its ``max_epochs``), and the fit trains the chosen layout."""
    os.environ.pop("WORLD_SIZE", None)
    trainer = Trainer(accelerator="cpu", devices=1, strategy={"name": "parallel", "plan": True}, max_steps=2,
                      max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    module = BatchKindsLM(batch_kind="dataclass", batch_size=4)
    try:
        trainer.fit(module)
    finally:
        trainer.strategy.teardown()  # the parallel strategy joins a process group even on one process
    assert trainer.global_step == 2 and trainer.config.strategy["chosen"]
    assert not torch.distributed.is_initialized()


class _FailsOnMeta(BatchKindsLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[1]).loss * batch[0].sum().item()


def test_a_step_that_cannot_run_on_meta_names_the_planner() -> None:
    """The failure says the planner ran the step, on meta, and what to do: the user's own error inside it
    (``.item()`` on a meta tensor) would otherwise read as a training failure."""
    from polytrain.trainer.launch.planned import first_batch, step_profiler

    with torch.device("meta"):
        module = _FailsOnMeta()
    with pytest.raises(ConfigError, match=r"the planner runs _FailsOnMeta's step once on one sample of the "
                                          r"first train batch, on the meta device .* raised "
                                          r"(RuntimeError|NotImpl).*pin the degrees"):
        step_profiler(module, first_batch(module.train_dataloader()), "cpu", None, "32", "cpu")(1)


LIBRARY_MODELS = ["gpt2", "llama", "qwen2", "bert", "resnet50", "vit_b_16", "convnext_tiny", "swin_t"]


@pytest.mark.parametrize("kind", LIBRARY_MODELS)
def test_every_library_model_the_suite_trains_plans_from_a_dict_batch(kind: str) -> None:
    """tests/test_own_models.py's models (each trained there under every strategy), their loader yielding
    dicts: profiled as from (inputs, targets) tuples, block for block."""
    import test_own_models as own
    from torch.utils.data import DataLoader, default_collate

    from polytrain.trainer.launch.planned import first_batch, step_profiler

    names = ("tokens",) if kind in own.LANGUAGE_MODELS else ("images", "labels")

    class DictBatches(own.HeldModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return own.loss_of(self.model, self.kind, [batch[n] for n in names])

        def train_dataloader(self) -> DataLoader:
            return DataLoader(own.dataset(self.kind), batch_size=self.batch_size,
                              collate_fn=lambda rows: dict(zip(names, default_collate(rows), strict=True)))

    profiles = []
    for cls in (own.HeldModel, DictBatches):
        with torch.device("meta"):
            module = cls(kind, own.GLOBAL_BATCH)
        profiles.append(step_profiler(module, first_batch(module.train_dataloader()), "cpu", None, "32",
                                      "cpu")(1))
    tuples, dicts = profiles
    assert len(dicts.children) == len(tuples.children) >= 3
    assert [(c.name, c.params, c.saved_bytes, c.flops, c.backward_bytes) for c in dicts.children] == [
        (c.name, c.params, c.saved_bytes, c.flops, c.backward_bytes) for c in tuples.children]
