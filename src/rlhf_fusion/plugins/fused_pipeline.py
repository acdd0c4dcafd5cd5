"""``FusedPipelineStrategy``: train a PPO Actor and Critic with one fused bidirectional pipeline.

A thin Lightning adapter over the fused pipeline engine
(:class:`rlhf_fusion.runtime.training_engine.FusedPipelineEngine`: it partitions in ``setup``
and plans at the first training step) and :mod:`rlhf_fusion.runtime.fused`
(``forward_backward`` and ``optimizer_step`` in ``training_step``); sharded checkpoint files are in
:mod:`.checkpoint`. A sibling of Lightning's ``DDPStrategy``. With ``world = dp * N`` processes, every group of N
consecutive ranks runs one replica of the fused pipeline: Actor stage s on rank s, Critic stage
s on rank N-1-s (or on the planner's placement when a model has several copies). The strategy

* checks, in the launching process, that the models and the schedule fit together;
* partitions the module's ``actor`` and ``critic`` in place (parameters keep their names);
* owns micro-batching, the schedule, every backward and both optimizer steps (manual
  optimization), gradient accumulation and clipping;
* gets the schedule from a file or from the planner fed with a short profiling pass;
* returns data-parallel coordinates (replica index / count) for samplers;
* logs losses reduced over all micro-batches and replicas;
* saves gathered (one file, the unpipelined layout) or sharded (one file per model stage)
  checkpoints and loads either back.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import Unpack, override

from ..placement.layout import FUSED_PIPELINE, Layout
from ..runtime.checkpoint import (
    aliases,
    local_optimizer_state,
    merge_named_states,
    named_optimizer_state,
    param_names,
)
from ..runtime.errors import PlanError
from ..runtime.fused import (
    ROLES,
    FusedRank,
    check_models_against_problem,
    forward_backward,
    fused_problem,
    optimizer_step,
)
from ..runtime.microbatch import split_micro_batches
from ..runtime.plan import PipelinePlan
from ..runtime.ppo import PPOConfig
from ..runtime.training_engine import EngineSpec, FusedPipelineEngine
from ..schedule import Problem, Schedule
from .checkpoint import load_shards, save_meta, save_shards
from .launcher import FusedPipelineLauncher
from .module import log_ppo_stats
from .process_group import ProcessGroupOptions, ProcessGroupStrategy

log = logging.getLogger(__name__)

CheckpointMode = Literal["auto", "gathered", "sharded"]


class FusedPipelineStrategy(ProcessGroupStrategy):
    """Fused bidirectional pipeline training of a PPO Actor and Critic.

    Args:
        stage_groups: N, the ranks one pipeline replica spans (default: all processes; the
            processes must be a multiple of N, the quotient is the data-parallel degree).
        actor_stages / critic_stages: pipeline stages per model (default N; a model with
            S < N stages runs N/S copies inside the pipeline).
        micro_batches: micro-batches per replica per step (default: the module's
            ``ppo_config.micro_batches``).
        actor_layers / critic_layers: decoder layers per stage (default: an even split).
        schedule: a schedule file (``Schedule.save``) or object to run instead of planning.
        solver / solver_time_limit: planner used on the profiled times.
        profile_repeats: timed passes over the first batch's micro-batches per stage in the
            profiling pass (after one warm-up pass; each micro-batch keeps its fastest time).
        schedule_out: where rank 0 writes the schedule it ran (reuse it with ``schedule=``).
        checkpoint: ``"gathered"`` (one file, the unpipelined layout), ``"sharded"`` (a
            directory with a file per model stage) or ``"auto"`` (gathered up to
            ``gathered_max_params`` parameters).
        **process_group: :class:`ProcessGroupOptions` (``timeout``: seconds any wait, be it
            an activation, a gradient or a collective, may take before the rank raises an
            error naming what it waited for; the backend, start method, accelerator, devices,
            cluster environment, checkpoint IO and precision plugin Lightning passes in).
    """

    strategy_name = "fused_pipeline"

    def __init__(
        self,
        stage_groups: int | None = None,
        *,
        actor_stages: int | None = None,
        critic_stages: int | None = None,
        micro_batches: int | None = None,
        actor_layers: Sequence[int] | None = None,
        critic_layers: Sequence[int] | None = None,
        schedule: str | os.PathLike | Schedule | None = None,
        solver: str = "auto",
        solver_time_limit: float = 10.0,
        profile_repeats: int = 2,
        schedule_out: str | os.PathLike | None = None,
        checkpoint: CheckpointMode = "auto",
        gathered_max_params: int = 2_000_000_000,
        **process_group: Unpack[ProcessGroupOptions],
    ) -> None:
        super().__init__(**process_group)
        if checkpoint not in ("auto", "gathered", "sharded"):
            raise ValueError(
                f"checkpoint: must be 'auto', 'gathered' or 'sharded', got {checkpoint!r}"
            )
        self._stage_groups = stage_groups
        self._actor_stages = actor_stages
        self._critic_stages = critic_stages
        self._micro_batches = micro_batches
        self._layers: dict[str, Sequence[int] | None] = {
            "actor": actor_layers,
            "critic": critic_layers,
        }
        # A schedule file is loaded (and re-validated) here, in the launching process.
        self._schedule: Schedule | None = (
            Schedule.load(schedule) if isinstance(schedule, (str, os.PathLike)) else schedule
        )
        self._solver = solver
        self._solver_time_limit = solver_time_limit
        self._profile_repeats = profile_repeats
        self._schedule_out = schedule_out
        self._checkpoint_mode: CheckpointMode = checkpoint
        self._gathered_max_params = gathered_max_params
        self._reset_fit_state()

    def _reset_fit_state(self) -> None:
        """The state ``setup`` creates for a fit (and ``teardown`` drops)."""
        # This rank's partitioned stages; its engine once the first step planned the schedule.
        self._fused: FusedRank | None = None
        self._engine: FusedPipelineEngine | None = None
        # The unpartitioned module's layout: checkpoints are written in it.
        self._full_param_names: list[str] = []
        self._full_state_keys: list[str] = []
        self._aliases: dict[str, str] = {}
        self._num_params = 0
        self._model_sizes: dict[str, float] = {}
        self._accumulated = 0
        # The gathered state dict at the end of a fit, for the launcher to hand back.
        self._trained: dict[str, Tensor] | None = None

    # -- Lightning plumbing ----------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """True only with data-parallel replicas.

        Lightning injects a (shuffling) DistributedSampler when this is True. Ranks of one
        pipeline replica must read the same batches, and with a single replica the user's own
        sampler is kept, so the batches equal those of a single-device run.
        """
        world = self.num_nodes * self.num_processes
        return world // self._resolved_stage_groups() > 1

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints are loaded into the partitioned module, so setup() must run first.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel coordinates: every rank of a pipeline replica reads the same data."""
        n = self._resolved_stage_groups()
        world = self.num_nodes * self.num_processes
        return {"num_replicas": max(1, world // n), "rank": self.global_rank // n}

    @property
    def schedule(self) -> Schedule | None:
        """The schedule being run (after the first training step when it is planned)."""
        fused_schedule = self._fused.schedule if self._fused is not None else None
        return fused_schedule if fused_schedule is not None else self._schedule

    @property
    def plan(self) -> PipelinePlan | None:
        """The rank layout and instruction streams being run (after the first training step)."""
        return self._fused.pipeline_plan if self._fused is not None else None

    @property
    def fused_rank(self) -> FusedRank | None:
        """This rank's stages, runners and engine (between ``setup`` and ``teardown``)."""
        return self._fused

    @override
    def _configure_launcher(self) -> None:
        self._launcher = FusedPipelineLauncher(
            self,
            start_method=self._start_method,
            timeout=self._timeout,
            preflight=self.preflight,
            trained_weights=self.trained_weights,
        )

    # -- layout and pre-flight checks --------------------------------------------------------------
    def _resolved_stage_groups(self) -> int:
        if self._stage_groups is not None:
            return self._stage_groups
        if self._schedule is not None:
            return self._schedule.problem.stage_groups
        return max(1, self.num_nodes * self.num_processes)

    def _layout(self, module: pl.LightningModule) -> tuple[Problem, int]:
        """The problem structure (stages, copies, micro-batches) and the replica count.

        Raises :class:`PlanError` naming the mismatch; called in the launching process before
        any worker starts, and again in every worker.
        """
        for role in ROLES:
            if not hasattr(module, role):
                raise PlanError(
                    f"{type(module).__name__} has no .{role}; FusedPipelineStrategy needs a "
                    "module with .actor and .critic (see rlhf_fusion.plugins.FusedPPOModule)"
                )
        if module.automatic_optimization:
            raise PlanError(
                f"{type(module).__name__}: set self.automatic_optimization = False; the "
                "strategy performs the backward passes and optimizer steps itself"
            )
        world = self.num_nodes * self.num_processes
        n = self._resolved_stage_groups()
        if world < 1 or world % n:
            raise PlanError(
                f"stage_groups: {n} does not divide the {world} processes; use devices = a "
                f"multiple of {n} (the rest become data-parallel replicas)"
            )
        cfg = getattr(module, "ppo_config", None)
        g = self._micro_batches or (cfg.micro_batches if cfg is not None else None)
        if g is None:
            raise PlanError("micro_batches: pass it to the strategy or set module.ppo_config")
        if self._schedule is not None:
            problem = self._schedule.problem
            if problem.stage_groups != n:
                raise PlanError(
                    f"schedule: plans {problem.stage_groups} stage groups but the strategy uses "
                    f"{n}; re-plan for {n} groups or set stage_groups={problem.stage_groups}"
                )
            for spec in problem.models:
                want = {"actor": self._actor_stages, "critic": self._critic_stages}.get(spec.name)
                if want is not None and want != spec.pipeline_stages:
                    raise PlanError(
                        f"schedule: {spec.name} has {spec.pipeline_stages} stages but "
                        f"{spec.name}_stages={want}; drop the argument or re-plan"
                    )
            totals = {m.copies * m.micro_batches for m in problem.models}
            if totals != {g}:
                raise PlanError(
                    f"schedule: processes {sorted(totals)} micro-batches per step but "
                    f"micro_batches is {g}; re-plan or set micro_batches={min(totals)}"
                )
        else:
            problem = fused_problem(
                stage_groups=n,
                micro_batches=g,
                actor_stages=self._actor_stages or n,
                critic_stages=self._critic_stages or n,
            )
        check_models_against_problem(
            problem, {"actor": module.actor, "critic": module.critic}, self._layers
        )
        return problem, world // n

    def preflight(self, module: pl.LightningModule) -> None:
        """Validate the module against the layout; raises before any process is started."""
        problem, replicas = self._layout(module)
        rank_zero_info(
            f"FusedPipelineStrategy: {replicas} replica(s) x {problem.stage_groups} stage groups; "
            + ", ".join(
                f"{m.name}: {m.pipeline_stages} stages x {m.copies} copies, "
                f"{m.micro_batches} micro-batches"
                for m in problem.models
            )
        )

    # -- setup / teardown --------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            if trainer.accumulate_grad_batches != 1:
                raise MisconfigurationException(
                    "FusedPipelineStrategy accumulates gradients itself: set "
                    "ppo_config.accumulate_batches instead of Trainer(accumulate_grad_batches)"
                )
            self._partition(module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 2:
                raise MisconfigurationException(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; the "
                    "FusedPipelineStrategy needs two: the Actor's, then the Critic's"
                )
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _partition(self, module: pl.LightningModule) -> None:
        problem, replicas = self._layout(module)
        # Names of the unpartitioned module: checkpoints are written in this layout.
        self._full_param_names = [n for n, _ in module.named_parameters()]
        self._full_state_keys = list(module.state_dict().keys())
        self._aliases = aliases(module)
        self._num_params = sum(p.numel() for p in module.parameters())
        self._model_sizes = {
            role: float(sum(p.numel() for p in getattr(module, role).parameters()))
            for role in ROLES
        }
        every = tuple(range(problem.stage_groups * replicas))
        # The fused pipeline engine partitions, plans (at the first step) and keeps the stages;
        # Lightning keeps the optimizers (configure_optimizers) and the step's arithmetic.
        self._engine = FusedPipelineEngine(EngineSpec(
            layouts={m.name: Layout(len(every) // m.pipeline_stages, pp=m.pipeline_stages,
                                    ranks=every, kind=FUSED_PIPELINE) for m in problem.models},
            targets={m.name: Layout(len(every), ranks=every) for m in problem.models},
            rank=self.global_rank, world=len(every), ppo=PPOConfig(),
            make_optimizers=lambda _params: {}, device=self.root_device, distributed=True,
            replicas=replicas, stage_groups=problem.stage_groups, solver=self._solver,
            solver_time_limit=self._solver_time_limit, timeout_s=self._timeout,
            loss_fns={"actor": module.actor_loss, "critic": module.critic_loss}, trace=False,
            problem=problem, layers=self._layers, sizes=self._model_sizes,
            profile_repeats=self._profile_repeats, schedule=self._schedule))
        self._engine.setup({role: getattr(module, role) for role in ROLES})
        self._fused = self._engine.fused
        log.debug(
            "rank %d holds %s",
            self.global_rank,
            {k: v.stage for k, v in self._fused.stages.items()},
        )

    def _build_pipeline(
        self, fused: FusedRank, micro_batches: Sequence[Mapping[str, Tensor]]
    ) -> None:
        """Plan (profiling first unless a schedule was given), then create groups and engine.

        Collective over all ranks; runs at the first training step.
        """
        assert self._engine is not None and self._engine.fused is fused
        self._engine.prepare(micro_batches)
        schedule = self._engine.schedule
        if self._schedule_out is not None and self.global_rank == 0:
            schedule.save(self._schedule_out)
        rank_zero_info(
            f"FusedPipelineStrategy: schedule from {schedule.solver}, predicted makespan "
            f"{schedule.makespan:.4g} (serial 1F1B "
            f"{schedule.baselines.get('serial_1f1b', {}).get('makespan', float('nan')):.4g})"
        )

    @override
    def on_train_end(self) -> None:
        # Collective, and only reached when the fit completed on every rank: gather the
        # trained weights now, while the partition exists (teardown comes before the launcher
        # collects results).
        super().on_train_end()
        if self._fused is None:
            return
        if self.checkpoint_mode == "gathered":
            state = self.gathered_state_dict()  # every rank takes part; rank 0 gets it
            self._trained = state if self.is_global_zero else None
        else:
            rank_zero_warn(
                "FusedPipelineStrategy: sharded checkpoint mode does not copy the trained "
                "weights back into the launching process; load them from a checkpoint"
            )

    def trained_weights(self) -> dict[str, Tensor] | None:
        """The full state dict gathered at the end of the last fit (rank 0; ``None``
        elsewhere, in sharded mode, or if the fit did not finish). Handed out once."""
        out, self._trained = self._trained, None
        return out

    @override
    def teardown(self) -> None:
        """Undo :meth:`setup`: close the engine and its process groups, drop the stages,
        runners, plan and layout state, and reset gradient accumulation."""
        trained = self._trained
        if self._fused is not None:
            self._fused.close()
        self._reset_fit_state()
        self._trained = trained  # the launcher collects it after teardown
        super().teardown()

    # -- the training step -------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        fused = self._fused
        assert module is not None and fused is not None
        batch = kwargs.get("batch", args[0] if args else None)
        cfg = getattr(module, "ppo_config", None)
        accumulate = int(getattr(cfg, "accumulate_batches", 1))
        max_norm = getattr(cfg, "max_grad_norm", None)
        mbs = split_micro_batches(batch, fused.micro_batches)
        with self.precision_plugin.train_step_context():
            if fused.engine is None:
                self._build_pipeline(fused, mbs)
            forward_backward(
                fused,
                mbs,
                loss_denominator=float(fused.micro_batches * fused.replicas * accumulate),
            )
        self._accumulated += 1
        norms = None
        if self._accumulated == accumulate:
            self._accumulated = 0
            norms = optimizer_step(fused, module.optimizers(), max_grad_norm=max_norm)
        assert fused.engine is not None
        stats = fused.engine.reduced_stats()
        stats = {role: {k: v * accumulate for k, v in st.items()} for role, st in stats.items()}
        log_ppo_stats(module, stats, norms, batch_size=int(batch["input_ids"].shape[0]))
        return torch.tensor(sum(st["loss"] for st in stats.values()))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._fused is not None:
            raise MisconfigurationException(
                "FusedPipelineStrategy pipelines training only; the models are partitioned "
                "during fit, so validation_step cannot run. Set limit_val_batches=0 and "
                "validate with a separate Trainer without this strategy (load the gathered "
                "checkpoint)."
            )
        return super().validation_step(*args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------------
    @property
    def checkpoint_mode(self) -> Literal["gathered", "sharded"]:
        if self._checkpoint_mode != "auto":
            return self._checkpoint_mode
        return "gathered" if self._num_params <= self._gathered_max_params else "sharded"

    def _canonical(self, role: str) -> bool:
        assert self._fused is not None
        return self._fused.is_canonical(role)

    def _owned_state(self) -> dict[str, Tensor]:
        """The entries of the module's state dict this rank contributes exactly once."""
        module = self.lightning_module
        assert module is not None and self._fused is not None
        out = {}
        for k, v in module.state_dict().items():
            role = k.split(".", 1)[0]
            if role in self._fused.stages:
                if not self._canonical(role):
                    continue
            elif self.global_rank != 0:
                continue
            out[k] = v.detach().cpu()
        return out

    def gathered_state_dict(self) -> dict[str, Tensor]:
        """The full, unpartitioned state dict on rank 0 ({} elsewhere). Collective."""
        if self._fused is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        parts: list[Any] = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(self._owned_state(), parts, dst=0)
        if self.global_rank != 0:
            return {}
        merged: dict[str, Tensor] = {}
        for part in parts:
            merged.update(part)
        missing = [k for k in self._full_state_keys if k not in merged]
        if missing:
            raise RuntimeError(f"gathered state dict misses {missing[:5]} (of {len(missing)})")
        return {k: merged[k] for k in self._full_state_keys}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._fused is None:
            return super().lightning_module_state_dict()
        if self.checkpoint_mode == "gathered":
            return self.gathered_state_dict()
        return self._owned_state()

    def _optimizer_role(self, optimizer: Any) -> str:
        opt = getattr(optimizer, "_optimizer", optimizer)
        for i, o in enumerate(self.optimizers):
            if getattr(o, "_optimizer", o) is opt:
                return ROLES[i]
        raise ValueError("optimizer is not one of the strategy's optimizers")

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._fused is None:
            return super().optimizer_state(optimizer)
        module = self.lightning_module
        assert module is not None
        opt = getattr(optimizer, "_optimizer", optimizer)
        role = self._optimizer_role(optimizer)
        keep = set(self._full_param_names) if self._canonical(role) else set()
        named = named_optimizer_state(opt, param_names(module), keep=keep)
        if self.checkpoint_mode == "sharded":
            return named
        parts: list[Any] = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(named, parts, dst=0)
        if self.global_rank != 0:
            return {}
        return merge_named_states(parts, self._full_param_names)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self._fused is None or self.checkpoint_mode == "gathered":
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(
                    checkpoint, filepath, storage_options=storage_options
                )
            return
        # Sharded: a directory with one file per (model, stage) written by its canonical holder,
        # plus the rest of the Lightning checkpoint from rank 0 (see plugins/checkpoint.py).
        path = Path(filepath)
        if self.is_global_zero:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        fused = self._fused
        save_shards(
            path,
            checkpoint,
            {
                role: (st.stage, st.num_stages)
                for role, st in fused.stages.items()
                if self._canonical(role)
            },
        )
        if self.is_global_zero:
            save_meta(path, checkpoint, {m.name: m.pipeline_stages for m in fused.problem.models})

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not path.is_dir():
            return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=False)
        stages = self._fused.stages if self._fused is not None else {}
        return load_shards(path, {role: (st.stage, st.num_stages) for role, st in stages.items()})

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        saved = checkpoint["state_dict"]
        local = module.state_dict()
        missing = [k for k in local if k not in saved]
        if strict and missing:
            raise KeyError(
                f"checkpoint misses {len(missing)} keys this rank needs, e.g. {missing[:3]}"
            )
        module.load_state_dict({k: saved[k] for k in local if k in saved}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        names = param_names(module)
        for opt, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            inner = getattr(opt, "_optimizer", opt)
            inner.load_state_dict(local_optimizer_state(inner, saved, names, self._aliases))
            _optimizers_to_device([inner], self.root_device)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if Path(filepath).is_dir():
                shutil.rmtree(filepath, ignore_errors=True)
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    # -- registry ----------------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "fused_pipeline",
            cls,
            description="Fused bidirectional pipeline for PPO Actor + Critic (rlhf-fusion)",
            override=True,
        )
