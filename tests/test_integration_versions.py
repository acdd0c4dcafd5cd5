"""The verl and OpenRLHF version guards (``integrations/_versions.py``), with neither installed:
the range each pins, the error class each raises, and the fix each names."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from rlhf_fusion.integrations.openrlhf import compat as openrlhf_compat
from rlhf_fusion.integrations.verl import compat as verl_compat
from rlhf_fusion.integrations.verl.options import VerlPluginError

pytest.importorskip("packaging")

CASES = [  # compat, distribution, its error, versions in range, out of range, the fix named
    (verl_compat, "verl", VerlPluginError, ("0.9.1", "0.9.7"), ("0.9.0", "0.10.0", "1.0"),
     "install verl==0.9.1 or unset RLHF_FUSION_VERL to run verl stock"),
    (openrlhf_compat, "openrlhf", openrlhf_compat.OpenRLHFVersionError, ("0.11.2", "0.11.9"),
     ("0.10.1", "0.11.1", "0.12.0"), "pip install 'openrlhf==0.11.2' or run OpenRLHF stock"),
]


@pytest.mark.parametrize(("compat", "dist", "error", "good", "bad", "fix"), CASES)
def test_the_range_is_checked_and_the_error_names_range_and_fix(compat, dist, error, good,
                                                                 bad, fix):
    for version in good:
        assert compat.check_version(version) == version
    for version in bad:
        with pytest.raises(error) as info:
            compat.check_version(version)
        assert str(info.value) == (
            f"{dist} {version} is not supported by rlhf_fusion.integrations.{dist} "
            f"(verified with {compat.SUPPORTED_TEXT}); {fix}")


@pytest.mark.parametrize(("compat", "dist", "error", "good", "bad", "fix"), CASES)
def test_the_installed_version_is_read_and_a_missing_one_names_the_extra(
        monkeypatch, compat, dist, error, good, bad, fix):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(error, match=re.escape(
            f"pip install 'rlhf-fusion[{dist}]' ({compat.SUPPORTED_TEXT})")):
        compat.check_version()
    monkeypatch.setattr(importlib.metadata, "version", {dist: bad[-1]}.__getitem__)
    with pytest.raises(error, match=re.escape(f"{dist} {bad[-1]} is not supported")):
        compat.check_version()
    monkeypatch.setattr(importlib.metadata, "version", {dist: good[0]}.__getitem__)
    assert compat.check_version() == good[0]
