"""The profiling pass measures activation memory, not placeholders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhf_fusion.runtime.fused import problem_from_profiles
from rlhf_fusion.runtime.profile import SavedTensorMeter

transformers = pytest.importorskip("transformers")

from rlhf_fusion.runtime.engine import TrainStageRunner  # noqa: E402
from rlhf_fusion.runtime.microbatch import position_ids_from_mask  # noqa: E402
from rlhf_fusion.runtime.partition import partition_  # noqa: E402
from rlhf_fusion.runtime.profile import profile_runner  # noqa: E402

HIDDEN = 32


def test_meter_counts_saved_activations_of_a_linear_stack():
    rows, d, layers = 64, 48, 3
    net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.ReLU())])
    x = torch.randn(rows, d, requires_grad=True)
    with SavedTensorMeter(exclude=net.parameters()) as meter:
        y = net(x)
    meter.add(y)
    # Each Linear saves its input, each ReLU its output (the next Linear's input: the same
    # storage); weights are parameters. So the input plus one [rows, d] tensor per layer.
    hand = (layers + 1) * rows * d * 4
    assert hand / 2 <= meter.bytes <= 2 * hand, (meter.bytes, hand)
    y.sum().backward()  # the graph is intact


def _stage0(layers: list[int]) -> TrainStageRunner:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=sum(layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    return TrainStageRunner(partition_(model, "actor", 0, len(layers), layers))


def _micro_batch(rows: int, seq: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(rows, seq, dtype=torch.long)
    ids = torch.randint(1, 64, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def test_profiled_activation_grows_with_layers_and_sequence():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = profile_runner(_stage0([1, 3]), _micro_batch(2, 16), repeats=1)
        three = profile_runner(_stage0([3, 1]), _micro_batch(2, 16), repeats=1)
        longer = profile_runner(_stage0([1, 3]), _micro_batch(2, 64), repeats=1)
        # The most memory-hungry micro-batch of several counts.
        mixed = profile_runner(
            _stage0([1, 3]), [_micro_batch(2, 16), _micro_batch(2, 64)], repeats=1
        )
    finally:
        torch.set_num_threads(prev)
    assert one.forward_s > 0 and one.backward_s > 0
    assert one.activation_bytes > 0
    assert three.activation_bytes > 1.5 * one.activation_bytes
    assert longer.activation_bytes > 2 * one.activation_bytes
    assert mixed.activation_bytes == longer.activation_bytes
    # A decoder layer keeps at least a few [rows, seq, hidden] fp32 tensors until backward,
    # and (for this size) well under a hundred.
    per_layer = three.activation_bytes - one.activation_bytes
    unit = 2 * 16 * HIDDEN * 4 * 2  # two extra layers
    assert 2 * unit <= per_layer <= 100 * unit, (per_layer, unit)


def test_problem_uses_measured_activation_in_mib():
    mib = 1 << 20
    profiles = [
        {"actor": (0, 1e-3, 2e-3, 3 * mib), "critic": (1, 1e-3, 2e-3, mib // 2)},
        {"actor": (1, 1e-3, 2e-3, 2 * mib), "critic": (0, 1e-3, 2e-3, mib)},
    ]
    kw = dict(stage_groups=2, micro_batches=4, actor_stages=2, critic_stages=2)
    problem = problem_from_profiles(profiles, **kw)
    spec = {m.name: m for m in problem.models}
    assert spec["actor"].activation == (3.0, 2.0)
    assert spec["critic"].activation == (1.0, 0.5)
    assert spec["actor"].forward == (1.0, 1.0)
    # Without a memory measurement every stage counts one unit per micro-batch in flight.
    legacy = problem_from_profiles([{k: v[:3] for k, v in p.items()} for p in profiles], **kw)
    assert {m.activation for m in legacy.models} == {(1.0, 1.0)}
