"""``rlhf_fusion.testing`` lists every module it ships: in its docstring's table and in the
lazy names that ``import rlhf_fusion.testing`` resolves on first access."""

from __future__ import annotations

import importlib
from pathlib import Path

import rlhf_fusion.testing as testing

SUBMODULES = sorted(p.stem for p in Path(testing.__file__).parent.glob("*.py")
                    if p.stem != "__init__")


def test_every_module_is_in_the_table_and_the_lazy_names():
    assert {"openrlhf", "trl", "vllm"} <= set(SUBMODULES)
    lazy = {m.lstrip(".") for m in testing._LAZY.values()}
    for name in SUBMODULES:
        assert f"``testing.{name}``" in testing.__doc__, name
        assert name in lazy, name


def test_every_public_name_of_a_module_resolves_from_the_package():
    for name in SUBMODULES:
        module = importlib.import_module(f"rlhf_fusion.testing.{name}")
        for attr in getattr(module, "__all__", ()):
            assert getattr(testing, attr) is getattr(module, attr), f"{name}.{attr}"
