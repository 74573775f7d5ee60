"""``_target_`` entries checked when a config is loaded, before any worker starts: the class is imported
and its keyword arguments matched against its signature, but nothing is constructed."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain import Trainer
from polytrain.trainer.config import ConfigError, load_config

# A user's module file next to the config. Building either class fails loudly: loading the config must not.
USER_CODE = '''
BUILT = []

class Expensive:
    def __init__(self, lr: float = 0.1, hidden: int = 8, batch_size: int = 4):
        BUILT.append(self)
        raise RuntimeError("Expensive was built while loading the config")

class NeedsRoot:
    def __init__(self, root: str, download: bool = False):
        raise RuntimeError("NeedsRoot was built while loading the config")

class TakesAnything:
    def __init__(self, lr: float = 0.1, **kwargs):
        raise RuntimeError("TakesAnything was built while loading the config")
'''


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # cleaned up after the test (the loader adds the config's dir)
    (tmp_path / "user_code_for_targets.py").write_text(USER_CODE)

    def write(text: str) -> str:
        path = tmp_path / "cfg.yaml"
        path.write_text(text)
        return str(path)

    return write


def _error(path: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_module_keyword_typo_names_the_key_the_closest_keyword_and_the_valid_ones(config) -> None:
    path = config("module: {_target_: user_code_for_targets.Expensive, lrr: 0.1}\n")
    assert _error(path) == ("module: user_code_for_targets.Expensive() got an unexpected keyword 'lrr'; did you "
                            "mean 'lr'? Valid: lr, hidden, batch_size")


def test_valid_keywords_load_without_building_anything(config) -> None:
    import user_code_for_targets

    load_config(config("module: {_target_: user_code_for_targets.Expensive, lr: 0.5, hidden: 3}\n"
                       "data: {_target_: user_code_for_targets.NeedsRoot, root: /data}\n"))
    assert user_code_for_targets.BUILT == []  # checked against the signature, never called


def test_missing_required_argument_is_named(config) -> None:
    message = _error(config("module: {_target_: user_code_for_targets.Expensive}\n"
                            "data: {_target_: user_code_for_targets.NeedsRoot, download: true}\n"))
    assert message == ("data: user_code_for_targets.NeedsRoot() is missing required argument(s) 'root': give them "
                       "under data:. Valid: root, download")


def test_a_class_taking_kwargs_accepts_any_keyword(config) -> None:
    load_config(config("module: {_target_: user_code_for_targets.TakesAnything, anything: 1}\n"))


def test_datamodule_section_and_nested_targets_are_checked(config) -> None:
    message = _error(config("module: {_target_: user_code_for_targets.Expensive}\n"
                            "datamodule: {_target_: user_code_for_targets.NeedsRoot, root: /d, downlaod: true}\n"))
    assert message.startswith("data: user_code_for_targets.NeedsRoot() got an unexpected keyword 'downlaod'; "
                              "did you mean 'download'?")
    nested = _error(config("module:\n  _target_: user_code_for_targets.TakesAnything\n"
                           "  net: {_target_: torch.nn.Linear, in_features: 2, out_feature: 1}\n"))
    assert nested.startswith("module.net: torch.nn.Linear() got an unexpected keyword 'out_feature'; did you mean "
                             "'out_features'?")


def test_callback_keyword_typo_is_caught_at_load(config) -> None:
    path = config("module: {_target_: user_code_for_targets.Expensive}\n"
                  "trainer:\n  callbacks:\n    - {_target_: polytrain.callbacks.ModelCheckpoint, monitr: val/acc}\n")
    assert _error(path).startswith("trainer.callbacks[0]: polytrain.callbacks.ModelCheckpoint() got an unexpected "
                                   "keyword 'monitr'; did you mean 'monitor'? Valid: dirpath, filename, monitor")


@pytest.mark.parametrize(("target", "expected"), [
    ("user_code_for_targets.Expensiv", "module 'user_code_for_targets' has no attribute 'Expensiv'; did you mean "
                                       "'Expensive'?"),
    ("user_code_for_target.Expensive", "cannot import module 'user_code_for_target' (no module named "
                                       "'user_code_for_target'; did you mean 'user_code_for_targets'?)"),
    ("polytrain.callbakcs.ModelCheckpoint", "no module named 'polytrain.callbakcs'; did you mean 'callbacks'?"),
])
def test_unimportable_target_names_what_failed_and_the_closest_name(config, target: str, expected: str) -> None:
    message = _error(config(f"module: {{_target_: {target}}}\n"))
    assert message.startswith(f"module: _target_ '{target}': ") and expected in message, message


def test_trainer_from_config_checks_module_targets_before_any_worker(config) -> None:
    cfg = {"module": {"_target_": "user_code_for_targets.Expensive", "lrr": 0.1},
           "trainer": {"accelerator": "cpu", "devices": 2, "logger": False}}
    with pytest.raises(ConfigError, match="got an unexpected keyword 'lrr'; did you mean 'lr'"):
        Trainer.from_config(cfg)
