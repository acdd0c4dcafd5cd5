"""One registry of generation backends: the loop and the TRL trainers build theirs through it,
so a new backend is one ``register_backend`` call."""

from __future__ import annotations

import pytest

from rlhf_fusion.integrations.trl.fusion import FusionConfig, FusionConfigError
from rlhf_fusion.loop import RLHFConfig
from rlhf_fusion.loop.resolve import resolve_run
from rlhf_fusion.rollout import backend_registry as registry
from rlhf_fusion.rollout.types import RolloutConfigError

CONFIG = {
    "world_size": 2,
    "models": {"actor": {"family": "llama", "layers": 2, "hidden": 32, "heads": 4,
                         "kv_heads": 2}},
    "generation": {"prompts_per_iteration": 8, "max_new_tokens": 8},
    "ppo": {"num_mini_batches": 2, "micro_batches": 2},
}


def _request(**kw):
    return registry.BackendRequest(copy_model=lambda: "copy", instance_id=3, max_batch_size=4,
                                   seed=0, **kw)


def test_a_registered_backend_is_one_name_for_the_loop_and_the_trl_trainers(monkeypatch):
    built = []
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    registry.register_backend("mine", lambda req: built.append(req) or "engine")
    assert registry.make_backend("mine", _request()) == "engine"
    assert built[0].instance_id == 3 and built[0].copy_model() == "copy"
    FusionConfig(backend="mine")  # accepted by the TRL config
    cfg = RLHFConfig.from_dict({**CONFIG, "generation": {**CONFIG["generation"],
                                                         "backend": "mine"}})
    resolve_run(cfg)  # and by the loop's


def test_an_unknown_backend_names_the_registered_ones():
    with pytest.raises(RolloutConfigError, match=r"\['reference', 'vllm'\].*register_backend"):
        registry.make_backend("sglang", _request())
    with pytest.raises(FusionConfigError, match="register_backend"):
        FusionConfig(backend="sglang")


def test_vllm_needs_a_checkpoint_and_copies_nothing():
    copies = []
    request = registry.BackendRequest(copy_model=lambda: copies.append(1), instance_id=0,
                                      max_batch_size=4, seed=0, checkpoint=None)
    with pytest.raises(RolloutConfigError, match="save_pretrained"):
        registry.make_backend("vllm", request)
    assert not copies
