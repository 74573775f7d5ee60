"""Hugging Face directories in and out: ``trainer.init_weights`` fills a module's ``PreTrainedModel`` from a
local directory under every strategy, each rank reading only its slices, and ``polytrain checkpoint export
--format hf`` turns any checkpoint into a directory ``from_pretrained`` loads.

The pretrained directories are written here by ``save_pretrained`` from small configs (nothing is
downloaded), their weights moved away from the library's initialisation so a run that ignored them would
show. Llama (grouped-query attention) under fsdp x2 (built on the meta device by the module itself), tensor
parallel 2 and a pipeline of 2; GPT-2 (its head tied to its embedding) under fsdp x2 and the pipeline;
Qwen2 (tied) under tensor parallel, as GPT-2's Conv1D layers have no tensor-parallel plan (a module gives
one with ``tensor_parallel_plan()``). Each run starts from the directory, checks every rank's local tensors
against the directory's slices, trains equal to a one-process loop started from ``from_pretrained(DIR)``,
and its sharded checkpoint is exported and loaded back.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers
from distributed import run_distributed
from test_own_models import GLOBAL_BATCH, HeldModel, build_model, dataset, loss_of, optimizer_for
from torch.utils.data import DataLoader

from polytrain import Callback, Trainer, TrainModule
from polytrain.callbacks import ModelCheckpoint
from polytrain.checkpoint import hugging_face
from polytrain.checkpoint.reading import read_checkpoint
from polytrain.core.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.torch_api  # DTensor layouts, DCP reads, safetensors slices

STEPS = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_pretrained(kind: str, directory: str, max_shard_size: str | None = None) -> str:
    """``kind``'s model saved as a Hugging Face directory, its weights moved off the library's init."""
    model = build_model(kind)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():  # a tied parameter is listed once: it stays tied
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def from_pretrained(directory: str) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), f"{directory}: {info}"  # no missing, unexpected or mismatched keys
    return model.eval()


@functools.cache
def reference(kind: str, directory: str) -> dict[str, torch.Tensor]:
    """A plain loop from ``from_pretrained(directory)`` on the global batch: its weights after STEPS."""
    model = from_pretrained(directory).train()
    optimizer = optimizer_for(model.parameters())
    loader = DataLoader(dataset(kind), batch_size=GLOBAL_BATCH)
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss_of(model, kind, batch).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(5))


class SliceProbe(Callback):
    """At the start of training, every rank's local part of each parameter of the model against the same
    part of the directory's tensor (read here with safetensors, whole), and how much the fill read."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.wrong: list[str] = []
        self.checked = 0

    def on_train_start(self, trainer: Any, module: Any) -> None:
        from safetensors import safe_open

        ties = hugging_face.tied_weights(module.model)
        files = hugging_face.PretrainedDirectory(self.directory).file_of
        for name, param in module.model.named_parameters(remove_duplicate=False):
            name = hugging_face.clean_path(name)
            key = name if name in files else ties.get(name, name)
            with safe_open(os.path.join(self.directory, files[key]), framework="pt") as f:
                whole = f.get_tensor(key)
            if hasattr(param, "to_local"):
                index = hugging_face._local_index(param)
                local = param.to_local().detach()
                expected = whole[index] if index is not None else None
            else:
                local, expected = param.detach(), whole
            if expected is not None and not torch.equal(local, expected.to(local.dtype)):
                self.wrong.append(name)
            self.checked += 1


def counting_reads() -> dict[str, int]:
    """Counts the elements the fill reads on this process (safetensors slices, at the one reading call)."""
    counts = {"elements": 0}
    original = hugging_face.PretrainedDirectory.read

    def read(self: Any, key: str, index: Any = None) -> torch.Tensor:
        tensor = original(self, key, index)
        counts["elements"] += tensor.numel()
        return tensor

    hugging_face.PretrainedDirectory.read = read  # type: ignore[method-assign]
    return counts


class BuiltOnMeta(HeldModel):
    """The module builds its model on the meta device itself (as large models are): nothing initialises
    LlamaRMSNorm (it has no reset_parameters), so only init_weights can give it values."""

    def __init__(self, kind: str, batch_size: int) -> None:
        TrainModule.__init__(self)
        self.kind, self.batch_size, self.batches_run = kind, batch_size, 0

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            with torch.device("meta"):
                self.model = build_model(self.kind)


def _fit_from_pretrained(rank: int, world_size: int, strategy: Any, runs: list[tuple[str, str, bool]],
                         root: str) -> dict[str, Any]:
    counts = counting_reads()
    tp = strategy.get("tp", 1) if isinstance(strategy, dict) else 1
    pp = strategy.get("pp", 1) if isinstance(strategy, dict) else 1
    out = {}
    for kind, directory, on_meta in runs:
        counts["elements"] = 0
        held = BuiltOnMeta if on_meta else HeldModel
        module = held(kind, GLOBAL_BATCH // (world_size // (tp * pp)))
        probe = SliceProbe(directory)
        trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS,
                          run_dir=os.path.join(root, kind), logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, timeout=120,
                          init_weights=directory, callbacks=[probe])
        trainer.fit(module)
        state = trainer.strategy.module_state_dict()  # a collective where the model is sharded
        total = sum(p.numel() for p in from_pretrained(directory).parameters())
        out[kind] = {"wrong": probe.wrong, "checked": probe.checked, "read": counts["elements"],
                     "total": total, "batches": module.batches_run,
                     "weights": {k: v.detach().clone() for k, v in state.items()},
                     "checkpoint": trainer.checkpoint_callback.last_model_path}
    return out


def export(checkpoint: str, output: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polytrain", "checkpoint", "export", checkpoint, output,
                           "--format", "hf", *extra], cwd=ROOT, capture_output=True, text=True, timeout=240)


def _check_run(kind: str, directory: str, result: list[dict[str, Any]], tmp: str, sharded: bool,
               what: str) -> None:
    want = reference(kind, directory)
    for rank, per_rank in enumerate(result):
        got = per_rank[kind]
        assert got["checked"] > 0 and not got["wrong"], f"{what} rank {rank}: {got['wrong']}"
        assert got["batches"] == STEPS
        if sharded:  # each rank read its part of the directory, not all of it
            assert 0 < got["read"] < got["total"], f"{what} rank {rank}: read {got['read']} of {got['total']}"
    weights = result[0][kind]["weights"]
    assert {k.removeprefix("model.") for k in weights} == set(want), what
    for key, value in want.items():
        torch.testing.assert_close(weights[f"model.{key}"], value, rtol=0, atol=1e-5, msg=f"{what}: {key}")
    # The run's checkpoint (a sharded directory) exported, and loaded back by transformers.
    checkpoint = result[0][kind]["checkpoint"]
    assert os.path.isdir(checkpoint) == sharded
    output = os.path.join(tmp, f"{kind}-exported")
    hugging_face.export_pretrained(checkpoint, output)  # in this process: the command is tested below
    exported = from_pretrained(output)
    saved = read_checkpoint(checkpoint)["model"]
    for key, value in exported.state_dict().items():
        assert torch.equal(value, saved[f"model.{key}"]), f"{what}: exported {key}"
    reference_model = from_pretrained(directory)
    reference_model.load_state_dict(want)
    with torch.no_grad():
        torch.testing.assert_close(exported(probe_tokens()).logits, reference_model(probe_tokens()).logits,
                                   rtol=0, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, runs", [
    # Llama built on meta by the module itself; GPT-2 built in __init__ (its tie inside one FSDP unit)
    ("fsdp", [("llama", True), ("gpt2", False)]),
    ({"name": "parallel", "tp": 2}, [("llama", False), ("qwen2", False)]),
    # GPT-2's tie spans the two stages: each stage reads its side of it
    ({"name": "parallel", "pp": 2, "schedule": "1f1b"}, [("llama", False), ("gpt2", False)]),
], ids=["fsdp2", "tp2", "pp2"])
def test_init_weights_gives_each_rank_its_slice_and_trains_equal_to_from_pretrained(
        strategy: Any, runs: list[tuple[str, bool]], tmp_path: Any) -> None:
    directories = {kind: write_pretrained(kind, str(tmp_path / f"{kind}-pretrained")) for kind, _ in runs}
    specs = [(kind, directories[kind], on_meta) for kind, on_meta in runs]
    result = run_distributed(_fit_from_pretrained, 2, strategy, specs, str(tmp_path), timeout=540)
    for kind, _ in runs:
        _check_run(kind, directories[kind], result, str(tmp_path), sharded=True, what=f"{kind} {strategy}")


def _single_fit(kind: str, directory: str, root: str, **options: Any) -> tuple[Any, HeldModel]:
    module = HeldModel(kind, GLOBAL_BATCH)
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, run_dir=root, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      init_weights=directory, **options)
    trainer.fit(module)
    return trainer, module


def test_one_process_starts_from_the_directory_and_exports_a_tied_model_as_save_pretrained_does(
        tmp_path: Any) -> None:
    directory = write_pretrained("gpt2", str(tmp_path / "pretrained"))
    trainer, module = _single_fit("gpt2", directory, str(tmp_path / "run"))
    want = reference("gpt2", directory)
    for key, value in want.items():
        torch.testing.assert_close(module.model.state_dict()[key], value, rtol=0, atol=1e-5, msg=key)
    output = str(tmp_path / "exported")
    done = export(trainer.checkpoint_callback.last_model_path, output, "--max-shard-size", "0.00003")
    assert done.returncode == 0, done.stderr
    assert "tied, stored once: lm_head.weight" in done.stdout
    # Past the size limit: several files and the index, as save_pretrained writes them.
    with open(os.path.join(output, hugging_face.INDEX_NAME)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(os.path.join(output, name)) for name in files)
    assert "lm_head.weight" not in index["weight_map"]  # stored once, under the embedding
    exported = from_pretrained(output)
    assert exported.lm_head.weight is exported.transformer.wte.weight  # tied again by transformers
    with torch.no_grad():
        trained = module.model.eval()(probe_tokens()).logits
        torch.testing.assert_close(exported(probe_tokens()).logits, trained, rtol=0, atol=0)
    with open(os.path.join(output, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt2"


def test_a_bf16_run_exports_bf16_weights_and_model_checkpoint_writes_the_directory_itself(
        tmp_path: Any) -> None:
    directory = write_pretrained("llama", str(tmp_path / "pretrained"))
    trainer, module = _single_fit("llama", directory, str(tmp_path / "run"), precision="bf16-true",
                                  callbacks=[ModelCheckpoint(save_hf=True)])
    checkpoint = trainer.checkpoint_callback.last_model_path
    output = trainer.checkpoint_callback.hf_model_path
    assert output == os.path.splitext(checkpoint)[0] + ".hf" and os.path.isdir(output)
    exported = transformers.AutoModelForCausalLM.from_pretrained(output, dtype="auto")
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    for key, value in module.model.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value), key
    # The command writes the same directory from the same file.
    again = str(tmp_path / "exported")
    assert export(checkpoint, again).returncode == 0
    assert sorted(os.listdir(again)) == sorted(os.listdir(output)) == ["config.json", "model.safetensors"]
    with pytest.raises(ConfigError, match="holds no Hugging Face PreTrainedModel"):
        Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                run_dir=str(tmp_path / "plain"), callbacks=[ModelCheckpoint(save_hf=True)]).fit(Plain())


class Plain(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)


class CountingSteps(HeldModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches_run += 1
        return super().training_step(batch, batch_idx)


def test_a_directory_of_another_model_is_refused_by_name_before_the_first_step(tmp_path: Any) -> None:
    other = build_model("llama")
    config = transformers.LlamaConfig(**{**other.config.to_dict(), "intermediate_size": 48})
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "other"))
    module = CountingSteps("llama", GLOBAL_BATCH)
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, run_dir=str(tmp_path / "run"), logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      init_weights=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"trainer\.init_weights: .*does not fit the model: 6 have another "
                                          r"shape there: model\.layers\.0\.mlp\.gate_proj\.weight \[48, 32\] "
                                          r"\(the model's: \[64, 32\]\)"):
        trainer.fit(module)
    assert module.batches_run == 0
    # A tensor the model does not have, and one it lacks, are named too.
    missing = str(tmp_path / "missing")
    write_pretrained("llama", missing)
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(missing, "model.safetensors"))
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, run_dir=str(tmp_path / "run2"), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, init_weights=missing)
    with pytest.raises(ConfigError, match=r"1 of the model's tensors are not in it: model\.norm\.weight"):
        trainer.fit(CountingSteps("llama", GLOBAL_BATCH))
    with pytest.raises(ConfigError, match=r"is not a directory"):
        Trainer(accelerator="cpu", init_weights=str(tmp_path / "nowhere"))


def test_a_resume_takes_precedence_over_init_weights_and_says_so(tmp_path: Any, caplog: Any) -> None:
    directory = write_pretrained("llama", str(tmp_path / "pretrained"))
    first, _ = _single_fit("llama", directory, str(tmp_path / "run"))
    resumed_from = first.checkpoint_callback.last_model_path
    module = HeldModel("llama", GLOBAL_BATCH)
    trainer = Trainer(accelerator="cpu", max_steps=STEPS + 1, run_dir=str(tmp_path / "run"), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, init_weights=directory)
    with caplog.at_level("INFO", logger="polytrain"):
        trainer.fit(module, ckpt_path=resumed_from)
    assert f"trainer.init_weights={directory} is not read: the run resumes from {resumed_from}" in caplog.text
    assert trainer.global_step == STEPS + 1


def test_export_refuses_a_checkpoint_without_a_model_and_an_existing_directory(tmp_path: Any) -> None:
    plain = str(tmp_path / "plain.ckpt")
    torch.save({"weight": torch.ones(2)}, plain)
    done = export(plain, str(tmp_path / "out"))
    assert done.returncode == 2 and "records no Hugging Face model" in done.stderr, done.stderr
    (tmp_path / "taken").mkdir()
    done = export(plain, str(tmp_path / "taken"))
    assert done.returncode == 2 and "exists: export writes a new directory" in done.stderr, done.stderr
    with pytest.raises(CheckpointError, match="records no Hugging Face model"):
        hugging_face.export_pretrained(plain, str(tmp_path / "out2"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


class TwoModels(HeldModel):
    """A module holding two library models: the first is Llama, the one trained is GPT-2 (``second``)."""

    def __init__(self) -> None:
        TrainModule.__init__(self)
        self.kind, self.batch_size, self.batches_run = "gpt2", GLOBAL_BATCH, 0
        self.first = build_model("llama")
        self.second = build_model("gpt2")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.second, "gpt2", batch)


def test_the_model_named_is_the_one_filled_and_exported(tmp_path: Any) -> None:
    directory = write_pretrained("gpt2", str(tmp_path / "pretrained"))
    module = TwoModels()
    llama_before = {k: v.clone() for k, v in module.first.state_dict().items()}
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, run_dir=str(tmp_path / "run"), logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      init_weights={"path": directory, "model": "second"})
    trainer.fit(module)
    for key, value in reference("gpt2", directory).items():
        torch.testing.assert_close(module.second.state_dict()[key], value, rtol=0, atol=1e-5, msg=key)
    for key, value in llama_before.items():  # the other model is left as it was built (no gradients reach it)
        assert torch.equal(module.first.state_dict()[key], value), key
    checkpoint = trainer.checkpoint_callback.last_model_path
    assert export(checkpoint, str(tmp_path / "second"), "--model", "second").returncode == 0
    assert type(from_pretrained(str(tmp_path / "second"))).__name__ == "GPT2LMHeadModel"
    assert export(checkpoint, str(tmp_path / "first")).returncode == 0  # the first the module holds
    assert type(from_pretrained(str(tmp_path / "first"))).__name__ == "LlamaForCausalLM"
    done = export(checkpoint, str(tmp_path / "none"), "--model", "third")
    assert done.returncode == 2 and "records no Hugging Face model at 'third'; it records 'first', " \
                                    "'second'" in done.stderr, done.stderr
    with pytest.raises(ConfigError, match=r"trainer.init_weights has no key 'modle'"):
        Trainer(accelerator="cpu", init_weights={"path": directory, "modle": "second"})


def test_a_float8_run_starts_from_the_directory_and_exports_plain_weights(tmp_path: Any) -> None:
    pytest.importorskip("torchao")
    directory = write_pretrained("llama", str(tmp_path / "pretrained"))
    trainer, module = _single_fit("llama", directory, str(tmp_path / "run"), float8=True)
    converted = [name for name, m in module.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted, "float8 converted no layer"
    output = str(tmp_path / "exported")
    assert export(trainer.checkpoint_callback.last_model_path, output).returncode == 0
    exported = from_pretrained(output)
    assert all(type(p.data) is torch.Tensor for p in exported.parameters())
    for key, value in module.model.state_dict().items():
        assert torch.equal(exported.state_dict()[key], torch.as_tensor(value).detach()), key
