"""Placement and execution-plan search (pure Python + numpy: imports no torch).

Where each model function call runs: FlexRLHF's placement ratios and presets (co-located,
interleaved, disaggregated with shadow models), ReaLHF's device meshes, per-call parallel
strategies, parameter reallocation, the Algorithm 1 estimator and the Metropolis-Hastings
search. Method and limits: ``docs/placement.md``.
"""

from .batch import BatchResult, max_batch
from .errors import PlacementError
from .estimate import Estimate, Estimator
from .graph import CALLS, MODELS, REQUIRED_MODELS, build_graph, calls_of
from .hardware import (
    A100_80G,
    H100_80G,
    HARDWARE,
    V100_32G,
    Cluster,
    DeviceGroup,
    Hardware,
    hardware,
)
from .layout import KINDS, Layout
from .mesh import DeviceMesh, enumerate_meshes, make_mesh, mesh_from_ranks
from .models import MODEL_PRESETS, ModelShape, resolve_model
from .plan import CallPlacement, ExecutionPlan
from .presets import (
    PRESET_NAMES,
    Placement,
    colocated_heuristic,
    placement_meshes,
    placement_plan,
    preset_plan,
    ratio_meshes,
)
from .problem import Fusion, PlacementProblem, load_config
from .profile import Profile, load_profile
from .realloc_plan import MeshLayout, ReallocPlan, Transfer, plan_realloc
from .search import SearchResult, candidates, count_plans, enumerate_best, search
from .strategy import check_strategy, strategies_for
from .timeline import Timeline, TNode, simulate

__all__ = [
    "BatchResult",
    "max_batch",
    "V100_32G",
    "A100_80G", "CALLS", "H100_80G", "HARDWARE", "MODELS", "MODEL_PRESETS", "PRESET_NAMES",
    "CallPlacement", "Cluster", "DeviceGroup", "DeviceMesh", "Estimate", "Estimator",
    "ExecutionPlan", "Fusion", "Hardware", "KINDS", "Layout", "MeshLayout", "ModelShape",
    "Placement", "PlacementError", "PlacementProblem", "ReallocPlan", "SearchResult", "TNode",
    "Timeline", "Transfer", "build_graph", "candidates", "check_strategy",
    "colocated_heuristic", "count_plans", "enumerate_best", "enumerate_meshes", "hardware",
    "load_config", "make_mesh", "mesh_from_ranks", "placement_meshes", "placement_plan",
    "plan_realloc", "preset_plan", "ratio_meshes", "resolve_model", "search", "simulate",
    "strategies_for",
    "Profile",
    "load_profile",
    "REQUIRED_MODELS",
    "calls_of",
]
