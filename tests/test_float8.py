"""``trainer.float8``: torchao's float8 Linear layers (forward and backward run on CPU too).

Float8's dynamic scales are each tensor's amax, so a rank's casts depend on the batch it sees: the
reference is a plain PyTorch loop over the same micro-batches each rank sees (the sampler's
``rank::world`` split), their mean loss per step. Scales are powers of two, so scaling a loss by 1/2
scales its float8 gradients exactly: the strategies then equal that loop up to summation order.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from polytrain import Trainer, TrainModule
from polytrain.core.errors import ConfigError
from polytrain.parallel.float8 import linears_to_convert, resolve_float8

pytestmark = pytest.mark.torch_api

SAMPLES, PER_RANK, STEPS, STOP_AT = 16, 2, 4, 2
FEATURES, CLASSES = 32, 10


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def _net(bias: bool | tuple[bool, bool] = True) -> nn.Sequential:
    """``bias``: whether net.0 and net.2 (the layers that convert) have one, both or each."""
    torch.manual_seed(0)
    bias_0, bias_2 = bias if isinstance(bias, tuple) else (bias, bias)
    # net.0 and net.2 convert; net.4 is the head (kept); net.6 has 20 features (not a multiple of 16)
    return nn.Sequential(nn.Linear(FEATURES, 64, bias=bias_0), nn.ReLU(), nn.Linear(64, 32, bias=bias_2),
                         nn.ReLU(), nn.Linear(32, 20), nn.ReLU(), nn.Linear(20, CLASSES))


class Float8Net(TrainModule):
    bias: bool | tuple[bool, bool] = True

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = _net(self.bias)
        self.steps_run = 0
        self.batches_run = 0  # a pipeline runs its stages, not training_step: counted once a batch here

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches_run += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=self.batch_size)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)  # a pipeline's last stage: training_step's loss

    def tensor_parallel_plan(self) -> dict[str, Any]:
        # torch's styles, as without float8: the strategy gives the converted layers torchao's float8 styles
        return {"net.0": ColwiseParallel(), "net.2": RowwiseParallel(), "net.4": ColwiseParallel(),
                "net.6": RowwiseParallel()}


class BiasFreeFloat8Net(Float8Net):
    """The converted layers without bias, as torchtitan's models are (see the tensor-parallel test)."""

    bias = False


class MixedBiasFloat8Net(Float8Net):
    """net.0 without bias, net.2 with one: under tensor parallelism net.2 stays in high precision."""

    bias = (False, True)


def test_which_linears_convert_and_why_the_others_do_not() -> None:
    module = Float8Net(PER_RANK)
    chosen, skipped = linears_to_convert(module, resolve_float8(True))
    assert chosen == ["net.0", "net.2"]
    assert skipped == {"net.4": "32 x 20 features: float8 matmuls take multiples of 16",
                       "net.6": "the output head (convert_head: true converts it)"}
    chosen, skipped = linears_to_convert(module, resolve_float8({"filter_fqns": ["net.2"],
                                                                 "convert_head": True}))
    assert chosen == ["net.0"] and skipped["net.2"] == "filter_fqns names 'net.2'"
    assert "multiples of 16" in skipped["net.6"]  # the head converts when asked, if its shape allows


@pytest.mark.parametrize("spec, words", [
    ({"recipe": "rowwize"}, "not one of torchao's recipes: tensorwise, rowwise, rowwise_with_gw_hp"),
    ({"recipes": "rowwise"}, "unknown key(s) ['recipes']; valid: recipe, filter_fqns, convert_head, "
                             "enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp"),
    ("yes", "use true, false, auto, or a mapping"),
])
def test_a_bad_float8_setting_names_the_valid_ones(spec: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        Trainer(float8=spec, accelerator="cpu", logger=False)
    assert words in str(info.value)


def test_float8_auto_is_on_where_the_device_multiplies_in_float8(tmp_path: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """``float8: auto`` converts nothing on a CPU (torchao would only emulate the matmuls) and says so; the
    planner costs it where the hardware has an fp8 peak, as ``true``."""
    assert resolve_float8("auto")["auto"] is True and resolve_float8(True)["auto"] is False
    module = Float8Net(PER_RANK)
    trainer = Trainer(float8="auto", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, run_dir=str(tmp_path))
    with caplog.at_level("INFO", logger="polytrain"):
        trainer.fit(module)
    assert _kind(module.net[0]) == "Linear"
    assert "float8: auto leaves the Linear layers in high precision: cpu has no float8 matmuls" in caplog.text


def test_without_torchao_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # Imports fail as if torchao were not installed, also where an earlier test of this process imported it
    for name in ("torchao.float8", "torchao.float8.float8_tensor_parallel"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"trainer.float8 needs torchao.*pip install 'polytrain\[float8\]'"):
        Trainer(float8=True, accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                enable_checkpointing=False, run_dir=str(tmp_path))  # with the config's other checks


def _plain_float8_loop(world: int, bias: bool | tuple[bool, bool] = True,
                       converted: tuple[str, ...] = ("0", "2")
                       ) -> tuple[nn.Module, torch.optim.Optimizer, list[list[int]], int]:
    """What the plain loops start from: the net with ``converted`` (net.0 and net.2) converted by torchao,
    its SGD, each rank's samples (the sampler gives rank r the samples r, r + world, ...) and the steps an
    epoch."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    net = _net(bias)
    convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda _m, name: name in converted)
    shares = [list(range(r, SAMPLES, world)) for r in range(world)]
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), shares, len(shares[0]) // PER_RANK


def reference(world: int, bias: bool | tuple[bool, bool] = True, pieces: int = 1, float8_steps: int = STEPS,
              converted: tuple[str, ...] = ("0", "2")) -> dict[int, dict[str, torch.Tensor]]:
    """A plain loop converting the same layers with torchao: each step, every rank's micro-batch (the
    sampler gives rank r the samples r, r + world, ...), the mean of their losses; with ``pieces``, each
    micro-batch runs as that many (a pipeline's micro-batches: float8's scales are each piece's own). After
    ``float8_steps`` steps it goes on with plain ``nn.Linear`` layers, the weights and momentum kept (a
    float8 checkpoint resumed with float8 off)."""
    net, optimizer, shares, per_epoch = _plain_float8_loop(world, bias, converted)
    x, y = _data().tensors
    snapshots = {}
    for step in range(1, STEPS + 1):
        if step == float8_steps + 1:
            plain = _net(bias)
            plain.load_state_dict(net.state_dict())
            momentum = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
            momentum.load_state_dict(optimizer.state_dict())
            net, optimizer = plain, momentum
        k = (step - 1) % per_epoch
        optimizer.zero_grad()
        batches = [s[k * PER_RANK:(k + 1) * PER_RANK] for s in shares]
        size = PER_RANK // pieces
        losses = [F.cross_entropy(net(x[b[i:i + size]]), y[b[i:i + size]]) for b in batches
                  for i in range(0, PER_RANK, size)]
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        if step in (STOP_AT, STEPS):
            snapshots[step] = {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    return snapshots


def _fit(strategy: Any, world: int, run_dir: str, max_steps: int, ckpt_path: str | None = None,
         float8: Any = True, module_class: type[Float8Net] = Float8Net, **options: Any) -> dict[str, Any]:
    module = module_class(PER_RANK)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, float8=float8, max_steps=max_steps,
                      run_dir=run_dir, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=max_steps == STOP_AT, num_sanity_val_steps=0, timeout=60,
                      **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    kinds = sorted({f"{name}:{_kind(m)}" for name, m in module.net.named_children()
                    if isinstance(m, nn.Linear)})
    state = trainer.strategy.module_state_dict()
    # Scales computed after the last optimizer step, for the next FSDP gather (float8 all-gather)
    local = {name: getattr(getattr(m, "weight", None), "_local_tensor", None)
             for name, m in module.net.named_children()}
    precomputed = sorted(name for name, t in local.items()
                         if getattr(t, "_precomputed_scale", None) is not None)
    return {"weights": {k: v.detach().clone() for k, v in state.items()}, "steps_run": module.steps_run,
            "batches_run": module.batches_run, "layers": kinds, "precomputed": precomputed,
            "styles": _tensor_parallel_styles(module.net)}


def _tensor_parallel_styles(net: nn.Module) -> dict[str, str]:
    """The tensor-parallel style each child was sharded with: the class whose input hook
    ``parallelize_module`` registered on it (a partial of the style's ``_prepare_input_fn``)."""
    found = {}
    for name, child in net.named_children():
        for hook in child._forward_pre_hooks.values():
            for cell in getattr(hook, "__closure__", None) or ():
                if isinstance(cell.cell_contents, functools.partial):
                    found[name] = cell.cell_contents.func.__qualname__.split(".")[0]
    return found


def _kind(linear: nn.Module) -> str:
    """Float8Linear or Linear, whatever class FSDP wrapped it in."""
    return "Float8Linear" if any(c.__name__ == "Float8Linear" for c in type(linear).__mro__) else "Linear"


def _stop_and_resume(rank: int, world: int, strategy: Any, root: str,
                     module_class: type[Float8Net] = Float8Net) -> dict[str, Any]:
    """A float8 fit stopped at ``STOP_AT`` (its checkpoint is ``last``), resumed from it to ``STEPS`` in
    float8, and again with float8 off."""
    return {"stopped": _fit(strategy, world, root, STOP_AT, module_class=module_class),
            "resumed": _fit(strategy, world, root, STEPS, ckpt_path="last", module_class=module_class),
            "resumed_off": _fit(strategy, world, root, STEPS, ckpt_path="last", module_class=module_class,
                                float8=False)}


# Run in a fresh interpreter: it consolidates each checkpoint (a file or a sharded directory) into one file
# of weights, loads both with weights_only=True, and names the torchao modules it imported (none may be).
_READ_WITHOUT_TORCHAO = """
import json, os, sys
import torch
from polytrain.cli import main
for source, output in json.loads(sys.argv[1]):
    if main(["checkpoint", "consolidate", source, output]) != 0:
        raise SystemExit(f"consolidate failed: {source}")
    torch.load(output, weights_only=True)
    if os.path.isfile(source):
        torch.load(source, weights_only=True)
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "torchao")))
"""


def _read_without_torchao(root: str) -> dict[str, torch.Tensor]:
    """The weights of ``root``'s first checkpoint (``version_0``), as a process that never imported torchao
    consolidates them; the checkpoint and the consolidated file both load with ``weights_only=True``."""
    checkpoints = os.path.join(root, "version_0", "checkpoints")
    with open(os.path.join(checkpoints, "latest"), encoding="utf-8") as fh:  # the newest one written
        source = os.path.join(checkpoints, fh.read().strip())
    output = os.path.join(root, "consolidated.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", _READ_WITHOUT_TORCHAO, json.dumps([[source, output]])],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stdout
    return torch.load(output, weights_only=True)


def _check_portable(root: str, out: list[dict[str, Any]], want: dict[int, dict[str, torch.Tensor]],
                    what: str) -> None:
    """The stopped run's checkpoint holds plain tensors (read without torchao: exactly the stopped weights),
    and the run resumed from it with float8 off equals the plain loop that goes on without float8."""
    stopped = {k: v for r in out for k, v in r["stopped"]["weights"].items()}  # a pipeline: each stage's
    consolidated = _read_without_torchao(root)
    _assert_close(consolidated, stopped, f"{what}, consolidated without torchao")
    assert all(torch.equal(consolidated[k], v) for k, v in stopped.items()), what  # bitwise
    assert all(layer.endswith(":Linear") for r in out for layer in r["resumed_off"]["layers"])
    resumed_off = {k: v for r in out for k, v in r["resumed_off"]["weights"].items()}
    _assert_close(resumed_off, want[STEPS], f"{what}, resumed with float8 off")


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=f"{what}: {key}")


LAYERS = ["0:Float8Linear", "2:Float8Linear", "4:Linear", "6:Linear"]


def test_one_process_in_float8_equals_the_plain_loop_and_resumes_exactly(tmp_path: Any) -> None:
    want = reference(1)
    out = _stop_and_resume(0, 1, "single", str(tmp_path))
    assert out["stopped"]["layers"] == LAYERS
    assert out["resumed"]["steps_run"] == STEPS - STOP_AT
    _assert_close(out["stopped"]["weights"], want[STOP_AT], "single")
    _assert_close(out["resumed"]["weights"], want[STEPS], "single, resumed")
    _check_portable(str(tmp_path), [out], reference(1, float8_steps=STOP_AT), "single")


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_in_float8_equal_the_plain_loop_and_resume_exactly(strategy: str, tmp_path: Any) -> None:
    want = reference(2)
    out = run_distributed(_stop_and_resume, 2, strategy, str(tmp_path), timeout=200)
    assert out[0]["stopped"]["layers"] == LAYERS
    assert all(r["resumed"]["steps_run"] == STEPS - STOP_AT for r in out)
    _assert_close(out[0]["stopped"]["weights"], want[STOP_AT], strategy)
    _assert_close(out[0]["resumed"]["weights"], want[STEPS], f"{strategy}, resumed")
    _check_portable(str(tmp_path), out[:1], reference(2, float8_steps=STOP_AT), strategy)


FLOAT8_GATHER = {"enable_fsdp_float8_all_gather": True}


def _gathered_bytes_and_fit(rank: int, world: int, root: str, float8: Any) -> dict[str, Any]:
    """Each FSDP all-gather's bytes (the whole gathered buffer, every rank's share) over a stopped and a
    resumed fit."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    sizes: list[int] = []
    original = param_group.foreach_all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        out = result.all_gather_output
        sizes.append(out.numel() * out.element_size())
        return result

    param_group.foreach_all_gather = counting
    try:
        stopped = _fit("fsdp", world, root, STOP_AT, float8=float8)
        resumed = _fit("fsdp", world, root, STEPS, ckpt_path="last", float8=float8)
    finally:
        param_group.foreach_all_gather = original
    resumed_off = _fit("fsdp", world, root, STEPS, ckpt_path="last", float8=False)
    return {"stopped": stopped, "resumed": resumed, "resumed_off": resumed_off,
            "gathered": sorted(set(sizes))}


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp_gathers_the_float8_weights_in_float8_and_trains_equal_to_the_plain_loop(tmp_path: Any) -> None:
    """With enable_fsdp_float8_all_gather, FSDP gathers net.0's and net.2's weights as one byte each (their
    biases and the other layers stay fp32), cast on each shard with the whole weight's scale: the same bits
    as casting after the gather, so the run equals the plain float8 loop as the fp32 gather does, and
    resumes exactly; the scales come from the all-reduce after each optimizer step."""
    want = reference(2)
    on = run_distributed(_gathered_bytes_and_fit, 2, str(tmp_path / "on"), FLOAT8_GATHER, timeout=200)
    off = run_distributed(_gathered_bytes_and_fit, 2, str(tmp_path / "off"), True, timeout=200)
    fp32 = {"0": 32 * 64 * 4 + 64 * 4, "2": 64 * 32 * 4 + 32 * 4, "4": 32 * 20 * 4 + 20 * 4,
            "6": 20 * 10 * 4 + 10 * 4}
    float8 = {**fp32, "0": 32 * 64 + 64 * 4, "2": 64 * 32 + 32 * 4}  # one byte a weight element
    assert off[0]["gathered"] == sorted(fp32.values())
    assert on[0]["gathered"] == sorted(float8.values())
    assert on[0]["stopped"]["layers"] == LAYERS and on[0]["resumed"]["steps_run"] == STEPS - STOP_AT
    assert on[0]["stopped"]["precomputed"] == ["0", "2"] and off[0]["stopped"]["precomputed"] == []
    _assert_close(on[0]["stopped"]["weights"], want[STOP_AT], "fsdp, float8 all-gather")
    _assert_close(on[0]["resumed"]["weights"], want[STEPS], "fsdp, float8 all-gather, resumed")
    # FSDP's float8 weights are torchao's wrapper tensors: the shards on disk are the plain tensors inside
    _check_portable(str(tmp_path / "on"), on[:1], reference(2, float8_steps=STOP_AT),
                    "fsdp, float8 all-gather")


def test_the_float8_all_gather_needs_tensorwise_scales() -> None:
    with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather needs recipe: tensorwise"):
        resolve_float8({"recipe": "rowwise", **FLOAT8_GATHER})
    assert resolve_float8(FLOAT8_GATHER)["precompute_float8_dynamic_scale_for_fsdp"] is True


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_pipeline_in_float8_equals_the_plain_loop_and_resumes_exactly(tmp_path: Any) -> None:
    """Two stages (net.0-net.2 and the rest), each batch of 2 in two micro-batches of one sample: equal
    to the plain float8 loop running those micro-batches (each cast with its own scales) and averaging
    their losses, and a resumed run ends there too."""
    want = reference(1, pieces=2)
    strategy = {"name": "pipeline", "pp": 2, "schedule": "gpipe", "n_microbatches": 2}
    out = run_distributed(_stop_and_resume, 2, strategy, str(tmp_path), timeout=200)
    assert all(r["resumed"]["batches_run"] == STEPS - STOP_AT for r in out)  # it went on from the checkpoint
    assert sorted(layer for r in out for layer in r["stopped"]["layers"]) == LAYERS  # each stage its own
    stopped = {k: v for r in out for k, v in r["stopped"]["weights"].items()}
    resumed = {k: v for r in out for k, v in r["resumed"]["weights"].items()}
    _assert_close(stopped, want[STOP_AT], "pipeline")
    _assert_close(resumed, want[STEPS], "pipeline, resumed")
    _check_portable(str(tmp_path), out, reference(1, pieces=2, float8_steps=STOP_AT), "pipeline")


ACCUMULATE, CLIP = 2, 0.05  # the clip binds: the gradient norms here are 0.1 to 1


def accumulated_reference(world: int) -> dict[int, dict[str, torch.Tensor]]:
    """The plain float8 loop with gradient accumulation and clipping by norm: each optimizer step, each
    rank's next ``ACCUMULATE`` micro-batches (each cast with its own scales), their mean loss's gradients
    clipped to a total norm of ``CLIP``."""
    net, optimizer, shares, per_epoch = _plain_float8_loop(world)
    x, y = _data().tensors
    snapshots, batch = {}, 0
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        for _ in range(ACCUMULATE):
            k = batch % per_epoch
            for s in shares:
                idx = s[k * PER_RANK:(k + 1) * PER_RANK]
                (F.cross_entropy(net(x[idx]), y[idx]) / (world * ACCUMULATE)).backward()
            batch += 1
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
        if step in (STOP_AT, STEPS):
            snapshots[step] = {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    return snapshots


def _accumulate_and_clip(rank: int, world: int, strategy: str, root: str) -> dict[str, Any]:
    options = {"accumulate_grad_batches": ACCUMULATE, "gradient_clip_val": CLIP}
    return {"stopped": _fit(strategy, world, root, STOP_AT, **options),
            "resumed": _fit(strategy, world, root, STEPS, ckpt_path="last", **options)}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, strategy", [(1, "single"), (2, "fsdp")])
def test_float8_with_accumulation_and_clipping_equals_the_plain_loop(world: int, strategy: str,
                                                                     tmp_path: Any) -> None:
    """Accumulating two micro-batches and clipping by norm work in float8 as without it: equal (1e-6) to
    the plain float8 loop doing the same, and a resumed run ends there too."""
    want = accumulated_reference(world)
    if world == 1:
        out = [_accumulate_and_clip(0, 1, strategy, str(tmp_path))]
    else:
        out = run_distributed(_accumulate_and_clip, world, strategy, str(tmp_path), timeout=200)
    assert out[0]["resumed"]["batches_run"] == (STEPS - STOP_AT) * ACCUMULATE
    _assert_close(out[0]["stopped"]["weights"], want[STOP_AT], f"{strategy}, accumulated and clipped")
    _assert_close(out[0]["resumed"]["weights"], want[STEPS], f"{strategy}, accumulated and clipped, resumed")


def test_a_float8_checkpoint_loads_with_float8_off_and_back(tmp_path: Any) -> None:
    """The converted layers keep weight and bias under their names: the checkpoint of a float8 run resumes
    in a run without float8 (which then trains nn.Linear), and a run without float8 resumes in float8."""
    float8_run, plain_run = str(tmp_path / "f8"), str(tmp_path / "plain")
    stopped = _fit("single", 1, float8_run, STOP_AT)
    plain = _fit("single", 1, float8_run, STOP_AT + 1, ckpt_path="last", float8=False)
    assert plain["layers"] == ["0:Linear", "2:Linear", "4:Linear", "6:Linear"] and plain["steps_run"] == 1
    _fit("single", 1, plain_run, STOP_AT, float8=False)
    back = _fit("single", 1, plain_run, STOP_AT + 1, ckpt_path="last")
    assert back["layers"] == LAYERS and back["steps_run"] == 1
    loaded = Float8Net(PER_RANK)
    loaded.load_state_dict({k: v for k, v in stopped["weights"].items()})  # strict: the same keys
    _assert_close({f"{k}": v for k, v in loaded.state_dict().items()}, stopped["weights"],
                  "float8 -> plain module")


def test_the_converted_layers_get_torchaos_float8_tensor_parallel_styles() -> None:
    """Under tp > 1 a ColwiseParallel/RowwiseParallel entry on a converted layer becomes torchao's float8
    style with the same layouts (its collectives then move float8); the layers kept in high precision keep
    torch's.
    Per-row scaling, a module's own parallelize() and another style on a float8 layer are refused in words."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from polytrain.parallel.float8 import convert_to_float8, with_float8_styles
    from polytrain.parallel.tensor_parallel import resolve_key

    module = BiasFreeFloat8Net(PER_RANK)
    convert_to_float8(module, resolve_float8(True))
    asked = {**module.tensor_parallel_plan(), "net.0": ColwiseParallel(use_local_output=False)}
    plan = with_float8_styles(module, asked, resolve_key)
    assert [type(plan[k]) for k in ("net.0", "net.2", "net.4", "net.6")] == [
        Float8ColwiseParallel, Float8RowwiseParallel, ColwiseParallel, RowwiseParallel]
    assert plan["net.0"].use_local_output is False  # the entry's layouts kept
    with pytest.raises(ConfigError, match="own parallelize"):
        with_float8_styles(module, None, resolve_key)
    from torch.distributed.tensor.parallel import SequenceParallel

    with pytest.raises(ConfigError, match=r"entry 'net.0' gives the float8 layer\(s\) \['net.0'\] the style "
                                          r"SequenceParallel"):
        with_float8_styles(module, {"net.0": SequenceParallel()}, resolve_key)
    rowwise = BiasFreeFloat8Net(PER_RANK)
    convert_to_float8(rowwise, resolve_float8({"recipe": "rowwise"}))
    with pytest.raises(ConfigError, match="needs recipe: tensorwise.*net.0 scales per row"):
        with_float8_styles(rowwise, rowwise.tensor_parallel_plan(), resolve_key)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, strategy", [(2, {"name": "parallel", "tp": 2}),
                                             (4, {"name": "parallel", "tp": 2, "dp_shard": 2})],
                         ids=["tp2", "dp_shard2_tp2"])
def test_tensor_parallel_in_float8_equals_the_plain_loop_and_resumes_exactly(world: int, strategy: dict,
                                                                            tmp_path: Any) -> None:
    """The converted layers sharded with torchao's float8 styles (the casts' scales are the whole tensors'
    amax, over the tp peers): equal within 1e-6 to the plain float8 loop on the data-parallel ranks'
    micro-batches (tp peers share one), and a resumed run ends there too. The converted layers have no
    bias, as torchtitan's (a biased one stays in high precision under tensor parallelism: the next test)."""
    want = reference(world // 2, bias=False)
    out = run_distributed(_stop_and_resume, world, strategy, str(tmp_path), BiasFreeFloat8Net, timeout=200)
    assert out[0]["stopped"]["layers"] == LAYERS
    assert out[0]["stopped"]["styles"] == {"0": "Float8ColwiseParallel", "2": "Float8RowwiseParallel",
                                           "4": "ColwiseParallel", "6": "RowwiseParallel"}
    assert all(r["resumed"]["steps_run"] == STEPS - STOP_AT for r in out)
    _assert_close(out[0]["stopped"]["weights"], want[STOP_AT], str(strategy))
    _assert_close(out[0]["resumed"]["weights"], want[STEPS], f"{strategy}, resumed")
    _check_portable(str(tmp_path), out[:1], reference(world // 2, bias=False, float8_steps=STOP_AT),
                    str(strategy))


def _biased_layer_under_tensor_parallelism(rank: int, world: int, root: str) -> dict[str, Any]:
    """polytrain's tp run of the mixed-bias net, then the same net with torchao's float8 styles applied by
    hand on both converted layers (biased net.2 included), trained on the same batches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    out = _stop_and_resume(rank, world, {"name": "parallel", "tp": 2}, root, MixedBiasFloat8Net)
    net, _, shares, per_epoch = _plain_float8_loop(1, MixedBiasFloat8Net.bias)
    assert dist.is_initialized()  # the fits' process group, which the loop below uses too
    parallelize_module(net, init_device_mesh("cpu", (world,)),
                       {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel(),
                        "4": ColwiseParallel(), "6": RowwiseParallel()})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _data().tensors
    for step in range(STEPS):
        k = step % per_epoch
        batch = shares[0][k * PER_RANK:(k + 1) * PER_RANK]
        optimizer.zero_grad()
        F.cross_entropy(net(x[batch]), y[batch]).backward()
        optimizer.step()
    out["by_hand"] = {f"net.{k}": v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_biased_layer_stays_in_high_precision_under_tensor_parallelism(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """torchao's float8 tensor-parallel styles cast a layer's output gradient to float8 at the layer's output,
    after its bias: the bias learns from the float8 gradient, where one process's learns from the
    high-precision one. Applied by hand to the biased net.2, the run ends measurably off the one-process
    float8 loop; polytrain keeps net.2 in high precision (saying so) and net.0, without bias, in float8,
    and equals the one-process loop converting net.0 alone (1e-6), resumed too. A model whose every
    converted layer has a bias converts nothing under tensor parallelism: an error says why."""
    from polytrain.parallel.float8 import convert_to_float8, with_float8_styles
    from polytrain.parallel.tensor_parallel import resolve_key

    out = run_distributed(_biased_layer_under_tensor_parallelism, 2, str(tmp_path), timeout=200)
    assert out[0]["stopped"]["layers"] == ["0:Float8Linear", "2:Linear", "4:Linear", "6:Linear"]
    assert out[0]["stopped"]["styles"] == {"0": "Float8ColwiseParallel", "2": "RowwiseParallel",
                                           "4": "ColwiseParallel", "6": "RowwiseParallel"}
    want = reference(1, bias=MixedBiasFloat8Net.bias, converted=("0",))
    _assert_close(out[0]["stopped"]["weights"], want[STOP_AT], "tp2, net.2 kept in high precision")
    _assert_close(out[0]["resumed"]["weights"], want[STEPS], "tp2, net.2 kept in high precision, resumed")
    one_process = reference(1, bias=MixedBiasFloat8Net.bias)[STEPS]  # net.0 and net.2 in float8
    off = max((out[0]["by_hand"][k] - v).abs().max().item() for k, v in one_process.items())
    print(f"\ntorchao's float8 styles on a biased layer, by hand, {STEPS} SGD steps: weights up to {off:.1e} "
          f"from one process")
    assert off > 1e-5, off  # ten times the tolerance the strategies are held to

    caplog.set_level(logging.INFO, logger="polytrain")
    mixed = MixedBiasFloat8Net(PER_RANK)
    convert_to_float8(mixed, resolve_float8(True))
    with_float8_styles(mixed, mixed.tensor_parallel_plan(), resolve_key)
    kept = "1 Linear layer(s) with a bias stay in high precision under tensor parallelism: net.2"
    assert kept in caplog.text
    biased = Float8Net(PER_RANK)
    convert_to_float8(biased, resolve_float8(True))
    with pytest.raises(ConfigError, match=r"converts no layer of Float8Net under tensor parallelism: every "
                                          r"converted layer has a bias \(net.0, net.2\)"):
        with_float8_styles(biased, biased.tensor_parallel_plan(), resolve_key)


class GPT2Held(TrainModule):
    """Hugging Face's GPT-2 held as one attribute: its layers are transformers' Conv1D, not nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 64, (4, 8))), batch_size=2)


class SmallLinear(Float8Net):
    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.net = nn.Sequential(nn.Linear(FEATURES, 20), nn.ReLU(), nn.Linear(20, CLASSES))


def test_float8_that_converts_nothing_is_an_error_naming_why(tmp_path: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Asked for, float8 on a model with no layer it converts would train in full precision without a word:
    it stops at the start of the fit, naming each candidate and why (GPT-2's Conv1D is not nn.Linear; a
    shape that is not a multiple of 16; the head). Where layers convert, the INFO line names them; ``auto``
    converting nothing says so at INFO."""
    from polytrain.parallel.float8 import convert_to_float8

    def fit(module: TrainModule, float8: Any = True) -> None:
        Trainer(strategy="single", accelerator="cpu", float8=float8, max_steps=1, run_dir=str(tmp_path),
                logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False).fit(module)

    with pytest.raises(ConfigError) as info:
        fit(GPT2Held())
    words = " ".join(str(info.value).split())
    assert words.startswith("trainer.float8 converts no layer of GPT2Held, so it would train in full "
                            "precision: model.lm_head (the output head (convert_head: true converts it)); "
                            "8 Conv1D layer(s) (model.transformer.h.0.attn.c_attn, "
                            "model.transformer.h.0.attn.c_proj, model.transformer.h.0.mlp.c_fc and 5 more): "
                            "transformers.pytorch_utils.Conv1D is not torch.nn.Linear"), words
    with pytest.raises(ConfigError, match=r"net.0 \(32 x 20 features: float8 matmuls take multiples of 16\); "
                                          r"net.2 \(the output head"):
        fit(SmallLinear(PER_RANK))
    caplog.set_level(logging.INFO, logger="polytrain")
    fit(Float8Net(PER_RANK))
    assert ("float8 (tensorwise): 2 Linear layers converted; kept in high precision: net.4 (32 x 20 "
            "features: float8 matmuls take multiples of 16); net.6 (the output head") in caplog.text
    auto = SmallLinear(PER_RANK)
    assert convert_to_float8(auto, resolve_float8("auto")) == []
    assert "float8: auto converts nothing: net.0 (32 x 20 features" in caplog.text


@pytest.mark.timeout(300)
def test_float8_composes_with_bf16_mixed_and_compile(tmp_path: Any) -> None:
    """Under autocast and torch.compile the converted layers still run float8 and the loss stays close to
    the same run without float8 (float8's e4m3 keeps 3 mantissa bits: a few per cent apart)."""
    losses = {}
    for float8 in (True, False):
        module = Float8Net(4)
        seen: list[float] = []
        original = module.training_step

        def step(batch: Any, batch_idx: int, original: Any = original,
                 seen: list[float] = seen) -> torch.Tensor:
            loss = original(batch, batch_idx)
            seen.append(loss.item())
            return loss

        module.training_step = step  # type: ignore[method-assign]
        trainer = Trainer(strategy="single", accelerator="cpu", precision="bf16-mixed", compile=True,
                          float8=float8,
                          max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                          enable_model_summary=False, run_dir=str(tmp_path / str(float8)))
        trainer.fit(module)
        assert _kind(module.net[0]) == ("Float8Linear" if float8 else "Linear") and len(seen) == 3
        losses[float8] = seen
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=0.1, atol=0)


def test_the_plan_of_a_float8_config_costs_float8_where_the_hardware_has_it(tmp_path: Any) -> None:
    """``polytrain plan`` reads trainer.float8: on h100 it costs the float8 linears, tensor parallel
    included (torchao's float8 styles, tensorwise); a per-row recipe rejects tp > 1 as the strategy does;
    on cpu (no fp8 peak: float8 is emulated) it says float8 is not costed."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = os.path.join(root, "examples", "gpt", "config_composed.yaml")

    def plan(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "polytrain", "plan", "-c", config, "--nodes", "1",
                               "--devices-per-node", "4", *args], cwd=root, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def ranked(out: str) -> list[list[str]]:
        return [row.split()[1:4] for row in out.split("columns:")[0].splitlines()[2:]
                if row.split() and row.split()[0].isdigit()]

    tensorwise = plan("--hardware", "h100", "trainer.float8=auto")  # auto: on, as the h100 has an fp8 peak
    assert tensorwise.splitlines()[0].endswith(", float8 linears")
    assert any(part.startswith("tp") for row in ranked(tensorwise) for part in row), tensorwise
    rowwise = plan("--hardware", "h100", "trainer.float8={recipe: rowwise}")
    assert "trainer.float8 with tensor parallelism (tp > 1) needs recipe: tensorwise" in rowwise
    assert ranked(rowwise) and not any(part.startswith("tp") for row in ranked(rowwise) for part in row)
    assert plan("--hardware", "cpu", "trainer.float8=auto").splitlines()[0].endswith(
        ", float8 not costed (cpu has no fp8 peak)")


GPT_STEPS, GPT_TOLERANCE = 50, 0.01  # every step's loss within 1 % of bf16's (measured: 0.08 % at most)


def _gpt_losses(float8: bool, run_dir: str) -> list[float]:
    """The GPT example (d_model 64, 2 blocks: every block Linear converts, the head stays) for 50 steps of
    bf16-mixed on one CPU process, its loss at each step."""
    import os

    from polytrain import Callback

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "examples", "gpt"))
    from gpt_module import CharGPT

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.values.append(float(outputs["loss"]))

    losses = Losses()
    torch.manual_seed(0)
    module = CharGPT(d_model=64, n_head=4, n_layer=2, block_size=32, batch_size=16)
    trainer = Trainer(strategy="single", accelerator="cpu", precision="bf16-mixed", float8=float8,
                      max_steps=GPT_STEPS, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, run_dir=run_dir, callbacks=[losses], seed=0)
    # oneDNN's float8 matmul on an Intel CPU with AMX took 130 ms for one of this model's (torch's own: 2 ms),
    # and the test 300 s instead of a few; both runs go without oneDNN, alike
    with torch.backends.mkldnn.flags(enabled=False):
        trainer.fit(module)
    assert _kind(module.net[1].mlp.fc) == ("Float8Linear" if float8 else "Linear")
    return losses.values


@pytest.mark.timeout(300)
def test_float8_follows_the_bf16_loss_of_the_gpt_example_and_a_wrong_scale_does_not(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 50 steps every float8 loss is within 1 % of bf16's. The tolerance is tight enough to catch a
    wrong scale: with every scale twice what the amax gives (the largest values saturate at e4m3's 448)
    some step's loss is further off than that (measured: 8 %)."""
    import torchao.float8.float8_utils as utils

    bf16 = _gpt_losses(False, str(tmp_path / "bf16"))
    float8 = _gpt_losses(True, str(tmp_path / "float8"))
    apart = [abs(a - b) / b for a, b in zip(float8, bf16, strict=True)]
    assert len(apart) == GPT_STEPS and max(apart) <= GPT_TOLERANCE, max(apart)
    assert bf16[-1] < 0.7 * bf16[0]  # it learned: the comparison is not between two flat lines
    right = utils.amax_to_scale
    monkeypatch.setattr(utils, "amax_to_scale", lambda *args, **kwargs: right(*args, **kwargs) * 2)
    wrong = _gpt_losses(True, str(tmp_path / "wrong"))
    wrong_apart = max(abs(a - b) / b for a, b in zip(wrong, bf16, strict=True))
    print(f"\nfloat8 against bf16, {GPT_STEPS} steps of the GPT example: every loss within "
          f"{max(apart):.2%}; with every scale doubled, {wrong_apart:.1%} off")
    assert wrong_apart > GPT_TOLERANCE


def test_without_torchao_polytrain_fit_says_so_before_any_worker_starts(tmp_path: Any) -> None:
    """The launcher's check of the config: one line and exit 2, no worker started (a two-process fit)."""
    blocker = tmp_path / "no_torchao"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torchao'] = None  # as if it were not installed\n")
    config = tmp_path / "cfg.yaml"
    config.write_text("module: {_target_: torch.nn.Linear, in_features: 2, out_features: 1}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "polytrain", "fit", "-c", str(config), "trainer.float8=true",
               "trainer.devices=2", "trainer.accelerator=cpu", f"trainer.run_dir={tmp_path / 'run'}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    [said] = done.stderr.strip().splitlines()
    opening = "polytrain: config error: trainer.float8 needs torchao, which is not installed ("
    assert said.startswith(opening), said
    assert said.endswith("): pip install 'polytrain[float8]' (torchao)"), said
    assert not (tmp_path / "run").exists()
