"""Analytic time and memory of one call on one mesh under one parallel strategy.

Time (seconds):

* training: (6 + 2 with recomputation)·P·tokens FLOPs at ``train_mfu``; per layer and
  micro-batch 4 (6 with recomputation) tensor-parallel all-reduces of the activations over
  NVLink; pipeline sends between stages; the 1F1B bubble (1 + (pp-1)/m) on all of it; one
  gradient all-reduce over data-parallel ranks and one optimizer pass per mini-batch;
* inference: 2·P·tokens FLOPs at ``infer_mfu``, 2 all-reduces per layer, the pipeline bubble;
* generation: a compute-bound prefill, then memory-bound decode steps that read the weights
  once per step (pipeline stages do not help: each stage reads its weights once per
  micro-batch) and each running sample's KV cache, plus per-layer launch and all-reduce latency.

Under ZeRO-3 (``strategy.zero == 3``) every micro-batch of a training call gathers the weights
twice (forward, backward) and reduce-scatters the gradients over the data-parallel ranks, an
inference micro-batch gathers once, and a decode step gathers every layer again (generation
in a ZeRO-3 layout; DeepSpeed-Chat's hybrid engine is a generation call in a tensor-parallel
layout instead, whose reallocation node is the engine's gather). Like the gradient all-reduce
above, the gathers are not overlapped with compute (an upper bound on ZeRO's prefetch).

``Profile`` replaces the FLOP-based forward/backward time of a layer by measured times over
power-of-two token counts, interpolated log-log. A training call whose layout (dp, tp, ZeRO-3;
pp 1) the profile measured on its ranks (``Profile.layout``) is costed from that measurement
alone, micro-batch by micro-batch: per micro-batch its layers' forward and backward and the
rest of the pass, with the layout's communication inside them (tp all-reduces, FSDP gathers
and reduce-scatters, as ReaLHF profiles a layer with "associated communication"), and per
mini-batch the step's measured extra seconds (gradient sync, clipping, the optimizer).

Memory (bytes per GPU): static is what lives between calls (a trainable model's bf16 weights,
gradients and its share of fp32 Adam state, sharded over data-parallel ranks as Megatron's
distributed optimizer; a frozen model's bf16 weights unless offloaded); dynamic is what one call
adds while it runs (activations, KV cache, logits, and a reallocated copy of the weights when
the call's layout is not the one the weights live in). ZeRO-3 divides the static bytes by dp
and adds two gathered layers to the dynamic ones (the one computing, the one prefetched).
"""

from __future__ import annotations

import math

from .graph import CALL_KIND, CALL_MODEL
from .hardware import Cluster, Hardware
from .layout import Layout
from .mesh import DeviceMesh
from .models import ModelShape
from .problem import PlacementProblem
from .profile import Profile

DECODE_LAYER_OVERHEAD_S = 1e-5   # kernel launches per layer and decode step (CUDA graphs)
GEN_OUT_BYTES_PER_TOKEN = 8      # token id (int32) + its logprob (fp32)
SCORE_BYTES_PER_TOKEN = 4        # one fp32 per token (logprob, value or reward)


def _allreduce(nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + lat


class CostModel:
    """Per-call costs for one problem, cached by (call, ranks, strategy)."""

    def __init__(self, problem: PlacementProblem, profiles: dict[str, Profile] | None = None):
        self.p = problem
        self.profiles = problem.profiles if profiles is None else profiles
        self._time: dict[tuple, float] = {}

    # -- helpers ---------------------------------------------------------------------------
    def hw(self, mesh: DeviceMesh) -> Hardware:
        return self.p.cluster.group(mesh.group).hardware

    @property
    def cluster(self) -> Cluster:
        return self.p.cluster

    def model(self, call: str) -> ModelShape:
        return self.p.models[CALL_MODEL[call]]

    def _dp_bw(self, mesh: DeviceMesh, s: Layout, hw: Hardware) -> float:
        inside = s.tp * s.dp <= mesh.n_gpus
        return (hw.nvlink_bw if inside else hw.ib_bw) * hw.comm_efficiency

    def _pp_bw(self, mesh: DeviceMesh, hw: Hardware) -> float:
        return (hw.nvlink_bw if mesh.n_nodes == 1 else hw.ib_bw) * hw.comm_efficiency

    def zero_gather(self, call: str, mesh: DeviceMesh, s: Layout) -> float:
        """Seconds of one ZeRO-3 all-gather (or gradient reduce-scatter) of a rank's (tp, pp)
        shard over the data-parallel ranks, layer by layer (0 without ZeRO-3)."""
        if not s.zero3:
            return 0.0
        m, hw = self.model(call), self.hw(mesh)
        shard = m.param_bytes / (s.tp * s.pp)
        return ((s.dp - 1) / s.dp * shard / self._dp_bw(mesh, s, hw)
                + m.layers / s.pp * hw.link_latency_s)

    def micro_batch(self, factor: int = 1) -> int:
        if self.p.whole_batch:     # DeepSpeed-Chat: a replica's whole share in one pass
            return self.p.batch
        return max(1, factor * self.p.micro_batch_tokens // self.p.seq_len)

    def trainable_params(self, model: str) -> float:
        """Parameters that get gradients and Adam state: all of them, or with ``lora_dim`` r
        the adapters r·(in + out) of every linear layer of every decoder layer (q, k, v, o,
        gate, up, down: DeepSpeed-Chat's ``--*_lora_module_name layers.``). The MLP width
        comes from the parameter count (params = embeddings + layers·(attention + 3·h·ffn))."""
        m = self.p.models[model]
        r = self.p.lora_dim
        if not r:
            return m.params
        h = m.hidden
        kv = h * m.kv_heads / m.heads
        attn = 2 * h * h + 2 * h * kv
        ffn = max(h, ((m.params - 2 * m.vocab * h) / m.layers - attn) / (3 * h))
        per_layer = r * ((h + h) * 2 + (h + kv) * 2 + 3 * (h + ffn))
        return m.layers * per_layer

    def _overlapped(self) -> bool:
        """ZeRO-3 prefetch overlaps the next layers' gathers with this layer's compute in
        training and inference forwards (DeepSpeed-Chat's config: overlap_comm,
        stage3_prefetch_bucket_size); the hybrid engine's per-layer gathers in decode do not
        (``_zero3_forward`` gathers a layer synchronously before running it)."""
        return self.p.parallelism == "deepspeed-chat"

    def gen_rounds(self, mesh: DeviceMesh, s: Layout,
                   resident: float | None = None) -> int:
        """Generation splits a replica's batch into rounds when its KV cache would not fit in
        half of the memory left free by what is resident on the GPU: ``resident`` bytes (the
        estimator passes every model's static memory there plus a reallocated copy), or,
        without a plan, the generating weights alone. ``whole_batch``: one round (HF
        ``generate`` on the replica's whole batch, as DeepSpeed-Chat does)."""
        if self.p.whole_batch:
            return 1
        m = self.model("actor_gen")
        hw = self.hw(mesh)
        b = math.ceil(self.p.batch / s.dp)
        kv = b * self.p.seq_len * m.kv_bytes_per_token / (s.tp * s.pp)
        if resident is None:
            resident = m.param_bytes / (s.tp * s.pp) / (s.dp if s.zero3 else 1)
        free = 0.5 * (hw.hbm_bytes * (1 - hw.memory_reserve) - resident)
        if free <= 0:
            return b
        return max(1, min(b, math.ceil(kv / free)))

    # -- time ------------------------------------------------------------------------------
    def feasible(self, call: str, mesh: DeviceMesh, s: Layout) -> bool:
        """Batch shape rules (as ReaLHF's candidate filter): every data-parallel replica of a
        training call gets samples in every mini-batch; inference calls need a sample per
        replica; training never runs on an inference-only group."""
        if CALL_KIND[call] == "train":
            if self.cluster.group(mesh.group).inference_only:
                return False
            return self.p.batch >= self.p.ppo_minibatches * s.dp
        return self.p.batch >= s.dp

    def time(self, call: str, mesh: DeviceMesh, s: Layout,
             resident: float | None = None) -> float:
        """``resident``: static bytes on the generation GPUs (see ``gen_rounds``)."""
        # generation depends on what is resident only through its number of rounds
        key = (call, mesh.ranks, s,
               self.gen_rounds(mesh, s, resident) if call == "actor_gen" else None)
        t = self._time.get(key)
        if t is None:
            kind = CALL_KIND[call]
            if kind == "train":
                t = self.train_time(call, mesh, s)
            elif kind == "inference":
                t = self.inference_time(call, mesh, s)
            else:
                t = self.generate_time(mesh, s, resident)
            self._time[key] = t
        return t

    def _layer_compute(self, call: str, tokens_per_gpu_replica: float, s: Layout,
                       hw: Hardware, backward: bool) -> float:
        """Seconds for one replica's stage to run ``tokens`` through its layers once (with a
        profile: plus what lies outside the layers, on the stage that holds it)."""
        m = self.model(call)
        prof = self.profiles.get(CALL_MODEL[call])
        layers = m.layers / s.pp
        if prof is not None and prof.forward:
            tok = tokens_per_gpu_replica / s.tp
            f = prof.layer_forward(tok)
            rest = prof.rest(tok, backward=False)
            if not backward:
                return layers * f + rest
            b = prof.layer_backward(tok)
            return (layers * (f + b + (f if self.p.gradient_checkpointing else 0.0))
                    + rest + prof.rest(tok, backward=True))
        # forward 2, activation gradients 2, weight gradients 2 (none for frozen weights under
        # LoRA), recomputation 2
        flops = (8 if self.p.gradient_checkpointing else 6) if backward else 2
        if backward and self.p.lora_dim:
            flops -= 2
        mfu = hw.train_mfu if backward else hw.infer_mfu
        return flops * m.params / s.pp * tokens_per_gpu_replica / (s.tp * hw.flops * mfu)

    def measured_layout(self, call: str, s: Layout) -> Profile | None:
        """The profile of ``call``'s model measured in layout ``s`` on its ranks, if any."""
        prof = self.profiles.get(CALL_MODEL[call])
        if prof is None or s.pp > 1:
            return None
        return prof.layout(s.dp, s.tp, s.zero)

    def train_time(self, call: str, mesh: DeviceMesh, s: Layout) -> float:
        m, hw, p = self.model(call), self.hw(mesh), self.p
        steps = p.ppo_minibatches * p.ppo_epochs
        per_step = p.batch / p.ppo_minibatches / s.dp            # samples per replica
        mbs = min(self.micro_batch(), max(1, int(per_step)))
        mb = max(1, math.ceil(per_step / mbs))                     # micro-batches per step
        lay = self.measured_layout(call, s)
        if lay is not None:
            one = lay.train_pass(mbs * p.seq_len, m.layers, p.gradient_checkpointing)
            return steps * (mb * one
                            + lay.step_seconds(self.trainable_params(CALL_MODEL[call])))
        tokens = per_step * p.seq_len                              # per replica per step
        compute = self._layer_compute(call, tokens, s, hw, backward=True)
        n_ar = 6 if p.gradient_checkpointing else 4
        nv = hw.nvlink_bw * hw.comm_efficiency
        tp_comm = 0.0
        if s.tp > 1:
            tp_comm = n_ar * (m.layers / s.pp) * (
                tokens * m.hidden * 2 * 2 * (s.tp - 1) / s.tp / nv + mb * hw.link_latency_s)
        pp_comm = 0.0
        if s.pp > 1:
            pp_comm = 2 * mb * (mbs * p.seq_len * m.hidden * 2 / s.tp / self._pp_bw(mesh, hw)
                                + hw.link_latency_s)
        # ZeRO-3: gather for forward and backward, reduce-scatter the gradients (of the
        # trainable parameters only), per micro-batch
        trainable = self.trainable_params(CALL_MODEL[call])
        gather = self.zero_gather(call, mesh, s)
        zero = mb * (2 * gather + gather * trainable / m.params)
        if self._overlapped():
            stage = (max(compute, zero) + tp_comm + pp_comm) * (1 + (s.pp - 1) / mb)
        else:
            stage = (compute + tp_comm + pp_comm + zero) * (1 + (s.pp - 1) / mb)
        bw = self._dp_bw(mesh, s, hw)
        grad_bytes = 2 * trainable / (s.tp * s.pp)
        if s.zero3:
            grad = 0.0
        elif s.zero == 2:   # reduce-scatter: half an all-reduce's traffic
            grad = (s.dp - 1) / s.dp * grad_bytes / bw + hw.link_latency_s if s.dp > 1 else 0.0
        else:
            grad = _allreduce(grad_bytes, s.dp, bw, hw.link_latency_s)
        # Adam reads and writes fp32 master, m, v and bf16 weight and grad: ~ 32 B per param.
        optim = 32 * trainable / (s.tp * s.pp * s.dp) / (hw.hbm_bw * hw.hbm_efficiency)
        return steps * (stage + grad + optim)

    def inference_time(self, call: str, mesh: DeviceMesh, s: Layout) -> float:
        m, hw, p = self.model(call), self.hw(mesh), self.p
        per_rep = p.batch / s.dp
        mbs = min(self.micro_batch(2), max(1, int(per_rep)))
        mb = max(1, math.ceil(per_rep / mbs))
        tokens = per_rep * p.seq_len
        compute = self._layer_compute(call, tokens, s, hw, backward=False)
        nv = hw.nvlink_bw * hw.comm_efficiency
        tp_comm = 0.0
        if s.tp > 1:
            tp_comm = 2 * (m.layers / s.pp) * (tokens * m.hidden * 2 * 2 * (s.tp - 1) / s.tp / nv
                                               + mb * hw.link_latency_s)
        pp_comm = 0.0
        if s.pp > 1:
            pp_comm = mb * (mbs * p.seq_len * m.hidden * 2 / s.tp / self._pp_bw(mesh, hw)
                            + hw.link_latency_s)
        zero = mb * self.zero_gather(call, mesh, s)
        if self._overlapped():
            return (max(compute, zero) + tp_comm + pp_comm) * (1 + (s.pp - 1) / mb)
        return (compute + tp_comm + pp_comm + zero) * (1 + (s.pp - 1) / mb)

    def decode_step(self, mesh: DeviceMesh, s: Layout) -> tuple[float, float, float]:
        """(fixed seconds, seconds per running sample, seconds per KV token) of one decode step
        of one replica: the linear form the rollout simulator's ClusterModel takes."""
        m, hw = self.model("actor_gen"), self.hw(mesh)
        bw = hw.hbm_bw * hw.hbm_efficiency
        weights = m.param_bytes / s.tp / bw + self.zero_gather("actor_gen", mesh, s)
        overhead = m.layers * DECODE_LAYER_OVERHEAD_S
        if s.tp > 1:
            overhead += m.layers * 2 * hw.link_latency_s
        if s.pp > 1:
            overhead += s.pp * hw.link_latency_s
        per_sample = 2 * m.params / (s.tp * s.pp * hw.flops * hw.infer_mfu)
        if s.tp > 1:
            per_sample += m.layers * 2 * m.hidden * 2 * 2 * (s.tp - 1) / s.tp / (
                hw.nvlink_bw * hw.comm_efficiency)
        per_kv = m.kv_bytes_per_token / (s.tp * s.pp) / bw
        return weights + overhead, per_sample, per_kv

    def prefill_per_token(self, mesh: DeviceMesh, s: Layout) -> float:
        m, hw = self.model("actor_gen"), self.hw(mesh)
        return 2 * m.params / (s.tp * s.pp * hw.flops * hw.infer_mfu)

    def generate_time(self, mesh: DeviceMesh, s: Layout,
                      resident: float | None = None) -> float:
        p = self.p
        b = math.ceil(p.batch / s.dp)
        rounds = self.gen_rounds(mesh, s, resident)
        per_round = math.ceil(b / rounds)
        base, per_sample, per_kv = self.decode_step(mesh, s)
        prefill = (self.prefill_per_token(mesh, s) * b * p.prompt_len * (1 + (s.pp - 1) / b)
                   + self.zero_gather("actor_gen", mesh, s))
        g = p.gen_len
        kv_tokens = per_round * (g * p.prompt_len + g * (g - 1) / 2)
        decode = g * (base + per_sample * per_round) + per_kv * kv_tokens
        return prefill + rounds * decode + self.lora_fuse_time(mesh, s)

    def lora_fuse_time(self, mesh: DeviceMesh, s: Layout) -> float:
        """The hybrid engine fuses the LoRA adapters into the weights before generating and
        unfuses them after (DeepSpeed ``hybrid_engine.py`` fuse_lora_weight/unfuse_lora_weight:
        W += scaling·A·B per linear, 2·r·in·out FLOPs each way, a read and a write of W, on
        the whole (gathered) layers). Unpinned ZeRO-3 unfuses layer by layer under one more
        gather (``unfuse_lora_weight_non_pinned``).
        """
        if not self.p.lora_dim:
            return 0.0
        m, hw = self.model("actor_gen"), self.hw(mesh)
        local = m.params / (s.tp * s.pp)
        one_way = (2 * self.p.lora_dim * local / (hw.flops * hw.infer_mfu)
                   + 2 * 2 * local / (hw.hbm_bw * hw.hbm_efficiency))
        return 2 * one_way + self.zero_gather("actor_gen", mesh, s)

    # -- memory ----------------------------------------------------------------------------
    def static_bytes(self, model: str, s: Layout, trainable: bool) -> float:
        """bf16 weights; for the trainable parameters (all, or the LoRA adapters beside frozen
        bf16 weights) also bf16 gradients and fp32 Adam state (master, m, v: 12 B). ZeRO-3
        shards all of it over dp, ZeRO-2 the gradients and Adam state, Megatron's distributed
        optimizer the Adam state."""
        m = self.p.models[model]
        tp_pp = s.tp * s.pp
        if not trainable:
            return 2 * m.params / tp_pp / (s.dp if s.zero3 else 1)
        t = self.trainable_params(model) / tp_pp
        frozen = (m.params / tp_pp if self.p.lora_dim else 0.0)
        if s.zero3:
            return (2 * frozen + 16 * t) / s.dp
        if s.zero == 2:
            return 2 * frozen + t * (2 + 14 / s.dp)
        return 2 * frozen + t * (2 + 2 + 12 / s.dp)

    def dynamic_bytes(self, call: str, mesh: DeviceMesh, s: Layout,
                      holds_copy: bool, resident: float | None = None) -> float:
        m, p = self.model(call), self.p
        kind = CALL_KIND[call]
        copy = m.param_bytes / (s.tp * s.pp) if holds_copy else 0.0
        if s.zero3:   # the copy is sharded too; two layers live gathered
            copy = copy / s.dp + 2 * m.param_bytes / m.layers / s.tp
        if kind == "generate":
            b = math.ceil(p.batch / s.dp)
            per_round = math.ceil(b / self.gen_rounds(mesh, s, resident))
            kv = per_round * p.seq_len * m.kv_bytes_per_token / (s.tp * s.pp)
            logits = per_round * m.vocab * 4 / s.tp
            return copy + kv + logits
        if kind == "inference":
            per_rep = p.batch / s.dp
            mbs = min(self.micro_batch(2), max(1, int(per_rep)))
            tok = mbs * p.seq_len
            return copy + tok * (m.vocab * 4 + 34 * m.hidden) / s.tp
        per_step = p.batch / p.ppo_minibatches / s.dp
        mbs = min(self.micro_batch(), max(1, int(per_step)))
        mb = max(1, math.ceil(per_step / mbs))
        tok = mbs * p.seq_len
        layers = m.layers / s.pp
        in_flight = min(s.pp, mb)
        if p.gradient_checkpointing:
            act = in_flight * layers * tok * m.hidden * 2 + tok * m.hidden * 34 / s.tp
        else:
            act = in_flight * layers * tok * m.hidden * 34 / s.tp
        logits = 2 * tok * m.vocab * 4 / s.tp
        return copy + act + logits

    def capacity(self, mesh_group: str) -> float:
        hw = self.cluster.group(mesh_group).hardware
        return hw.hbm_bytes * (1 - hw.memory_reserve)

    def data_bytes(self, parent_call: str) -> float:
        """What a call hands to the next: generated tokens + logprobs, or one score per token."""
        per_token = GEN_OUT_BYTES_PER_TOKEN if parent_call == "actor_gen" else SCORE_BYTES_PER_TOKEN
        return self.p.batch * self.p.seq_len * per_token
