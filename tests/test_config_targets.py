"""``_target_`` entries checked when a config is loaded, before any worker starts: the class is imported
and its keyword arguments matched against its signature, but nothing is constructed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from polytrain import Trainer
from polytrain.trainer.configuration.config import ConfigError, load_config

pytestmark = pytest.mark.own_logic

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
    assert _error(path) == ("module: user_code_for_targets.Expensive() got an unexpected keyword 'lrr'; "
                            "did you mean 'lr'? Valid: lr, hidden, batch_size")


def test_valid_keywords_load_without_building_anything(config) -> None:
    import user_code_for_targets

    load_config(config("module: {_target_: user_code_for_targets.Expensive, lr: 0.5, hidden: 3}\n"
                       "data: {_target_: user_code_for_targets.NeedsRoot, root: /data}\n"))
    assert user_code_for_targets.BUILT == []  # checked against the signature, never called


def test_missing_required_argument_is_named(config) -> None:
    message = _error(config("module: {_target_: user_code_for_targets.Expensive}\n"
                            "data: {_target_: user_code_for_targets.NeedsRoot, download: true}\n"))
    assert message == ("data: user_code_for_targets.NeedsRoot() is missing required argument(s) 'root': "
                       "give them under data:. Valid: root, download")


def test_a_class_taking_kwargs_accepts_any_keyword(config) -> None:
    load_config(config("module: {_target_: user_code_for_targets.TakesAnything, anything: 1}\n"))


def test_datamodule_section_and_nested_targets_are_checked(config) -> None:
    message = _error(config("module: {_target_: user_code_for_targets.Expensive}\n"
                            "datamodule: {_target_: user_code_for_targets.NeedsRoot, root: /d, "
                            "downlaod: true}\n"))
    assert message.startswith("data: user_code_for_targets.NeedsRoot() got an unexpected keyword 'downlaod'; "
                              "did you mean 'download'?")
    nested = _error(config("module:\n  _target_: user_code_for_targets.TakesAnything\n"
                           "  net: {_target_: torch.nn.Linear, in_features: 2, out_feature: 1}\n"))
    assert nested.startswith("module.net: torch.nn.Linear() got an unexpected keyword 'out_feature'; "
                             "did you mean 'out_features'?")


def test_callback_keyword_typo_is_caught_at_load(config) -> None:
    path = config("module: {_target_: user_code_for_targets.Expensive}\n"
                  "trainer:\n  callbacks:\n    - {_target_: polytrain.callbacks.ModelCheckpoint, "
                  "monitr: val/acc}\n")
    assert _error(path).startswith("trainer.callbacks[0]: polytrain.callbacks.ModelCheckpoint() got an "
                                   "unexpected keyword 'monitr'; did you mean 'monitor'? Valid: dirpath, "
                                   "filename, monitor")


@pytest.mark.parametrize(("target", "expected"), [
    ("user_code_for_targets.Expensiv", "module 'user_code_for_targets' has no attribute 'Expensiv'; "
                                       "did you mean 'Expensive'?"),
    ("user_code_for_target.Expensive", "cannot import module 'user_code_for_target' (no module named "
                                       "'user_code_for_target'; did you mean 'user_code_for_targets'?)"),
    ("polytrain.callbakcs.ModelCheckpoint",
     "no module named 'polytrain.callbakcs'; did you mean 'callbacks'?"),
])
def test_unimportable_target_names_what_failed_and_the_closest_name(config, target: str,
                                                                    expected: str) -> None:
    message = _error(config(f"module: {{_target_: {target}}}\n"))
    assert message.startswith(f"module: _target_ '{target}': ") and expected in message, message


def test_trainer_from_config_checks_module_targets_before_any_worker(config) -> None:
    cfg = {"module": {"_target_": "user_code_for_targets.Expensive", "lrr": 0.1},
           "trainer": {"accelerator": "cpu", "devices": 2, "logger": False}}
    with pytest.raises(ConfigError, match="got an unexpected keyword 'lrr'; did you mean 'lr'"):
        Trainer.from_config(cfg)


# ------------------------------------------------------------------- read from the source, before torch

# A package the way users lay one out: re-exports, a base class, factories, names made at run time.
SOURCE_PACKAGE = {
    "__init__.py": "from .models import Net, Child as Renamed\nfrom . import factories\n",
    "models.py": '''
import math

class Base:
    def __init__(self, width: int = 4, depth: int = 2):
        pass

class Net(Base):
    def __init__(self, width: int, dropout: float = 0.0, *, act: str = "relu"):
        super().__init__(width)

class Child(Base):
    pass

class NoInit:
    pass

class Loose:
    def __init__(self, lr=0.1, **rest):
        pass

def decorate(cls):
    return cls

@decorate
class Decorated:
    def __init__(self, a: int = 1):
        pass

if math.pi > 3:
    class Conditional:
        def __init__(self, b: int = 1):
            pass
''',
    "runtime.py": 'globals()["Made"] = type("Made", (), {})\n',
    "factories.py": '''
def make(size: int, /, scale: float = 1.0, *args, seed: int):
    return None
''',
}

TARGET_SPECS = [
    ({"_target_": "srcpkg.Net", "width": 3, "dropot": 0.1}, "decided"),  # re-exported from models
    ({"_target_": "srcpkg.Net"}, "decided"),  # 'width' missing
    ({"_target_": "srcpkg.Net", "width": 3, "act": "gelu"}, "passes"),
    ({"_target_": "srcpkg.models.Net", "width": 3, "depth": 1}, "decided"),  # the base's keyword is not Net's
    ({"_target_": "srcpkg.models.Nett", "width": 3}, "decided"),
    ({"_target_": "srcpkg.models.NoInit", "width": 3}, "decided"),
    ({"_target_": "srcpkg.models.NoInit"}, "passes"),
    ({"_target_": "srcpkg.models.Loose", "anything": 1}, "passes"),
    ({"_target_": "srcpkg.models.Net", "width": {"_target_": "srcpkg.models.NoInit", "x": 1}}, "decided"),
    ({"_target_": "srcpkg.factories.make", "size": 1, "seed": 0}, "decided"),  # size is positional-only
    ({"_target_": "srcpkg.factories.make", "scale": 2.0}, "decided"),  # size and seed missing
    ({"_target_": "srcpkg.Renamed", "widht": 3}, "undecided"),  # inherited __init__
    ({"_target_": "srcpkg.models.Decorated", "b": 1}, "undecided"),
    ({"_target_": "srcpkg.models.Conditional", "c": 1}, "undecided"),
    ({"_target_": "srcpkg.runtime.Made", "x": 1}, "undecided"),  # made at run time
    ({"_target_": "srcpkg.missing.Thing"}, "undecided"),  # the import words a missing module
    ({"_target_": "polytrain.callbacks.ModelCheckpoint", "asyncsave": True}, "decided"),  # a lazy export
]


@pytest.mark.parametrize("spec, outcome", TARGET_SPECS, ids=[f"{s['_target_']}-{o}" for s, o in TARGET_SPECS])
def test_the_source_reading_says_what_the_import_says_or_leaves_it_to_the_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict, outcome: str) -> None:
    """``polytrain`` reads ``_target_`` signatures from the source before torch loads (``target_source.py``);
    what it decides must be what importing the class decides (``targets.check_spec``), and what it cannot
    settle it must leave alone."""
    from polytrain.trainer.configuration.target_source import check_targets_from_source
    from polytrain.trainer.configuration.targets import check_spec

    package = tmp_path / "srcpkg"
    package.mkdir()
    for name, text in SOURCE_PACKAGE.items():
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "srcpkg" or m.startswith("srcpkg.")]:
        monkeypatch.delitem(sys.modules, name)

    def said(check: Any) -> str | None:
        try:
            check()
        except ConfigError as err:
            return str(err)
        return None

    early = said(lambda: check_targets_from_source({"module": dict(spec), "config_dir": str(tmp_path)}))
    full = said(lambda: check_spec(dict(spec), "module", str(tmp_path)))
    if outcome == "passes":
        assert early is None and full is None
    elif outcome == "decided":
        assert early is not None and early == full, (early, full)
    else:
        assert early is None and (full is not None or spec["_target_"].endswith("Made")), full


def test_the_source_reading_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is read, not run: a module whose import would fail (or train) is still checked."""
    from polytrain.trainer.configuration.target_source import check_targets_from_source

    (tmp_path / "explodes_on_import.py").write_text(
        'raise SystemExit("imported")\n\n'
        'class Model:\n    def __init__(self, lr: float = 0.1):\n        pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"Model\(\) got an unexpected keyword 'lrr'; did you mean 'lr'"):
        check_targets_from_source({"module": {"_target_": "explodes_on_import.Model", "lrr": 1}})
    check_targets_from_source({"module": {"_target_": "explodes_on_import.Model", "lr": 1}})
    assert "explodes_on_import" not in sys.modules
