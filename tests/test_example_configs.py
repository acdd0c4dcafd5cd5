"""The configs shipped in examples/configs run through ``rlhf-fusion train`` (1 iteration,
shorter responses), and docs/loop.md documents every config field with the code's default."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from rlhf_fusion.cli import main
from rlhf_fusion.loop import RLHFConfig
from rlhf_fusion.loop.models import _SOURCE_KEYS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def test_the_examples_ship():
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "serial.yaml", "offload.yaml",
                                        "qwen-hub.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_trains(tmp_path, path, capsys):
    """As shipped, except: 1 iteration, 8 prompts of 16 tokens, and a Hub actor replaced by a
    local tiny folder of the same kind (no network here)."""
    data = yaml.safe_load(path.read_text())
    RLHFConfig.from_file(path)   # the file itself reads
    if isinstance(data["models"]["actor"], str):
        from rlhf_fusion.testing.trl import tiny_model_dir

        data["models"]["actor"] = tiny_model_dir(tmp_path / "local-model")
    data["generation"].update(prompts_per_iteration=8, max_new_tokens=16)
    data["prompts"] = str(path.parent / data["prompts"])
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert main(["train", str(run), "--out", str(out), "--iterations", "1"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0] and rows[0]["samples"] == 8


# --------------------------------------------------------------------------------------------
# docs/loop.md: every field, with the code's default
# --------------------------------------------------------------------------------------------

ROW = re.compile(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", re.M)


def documented() -> dict[str, str]:
    text = (ROOT / "docs" / "loop.md").read_text()
    section = text.split("## Every field", 1)[1].split("\n## ", 1)[0]
    return dict(ROW.findall(section))


def code_fields() -> dict[str, object]:
    out: dict[str, object] = {}
    cfg = RLHFConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{f.name}.{g.name}": getattr(value, g.name)
                    for g in dataclasses.fields(value)}
        else:
            out[f.name] = value
    return out


def test_docs_document_every_field_with_its_default():
    docs, code = documented(), code_fields()
    tiny = {k: v for k, v in docs.items() if k.startswith("tiny.")}
    fields = {k: v for k, v in docs.items() if not k.startswith("tiny.")}
    assert sorted(fields) == sorted(code)
    for name, default in fields.items():
        assert yaml.safe_load(default) == code[name], name
    assert sorted(k.split(".", 1)[1] for k in tiny) == sorted([*_SOURCE_KEYS, "seed"])
