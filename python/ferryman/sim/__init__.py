"""``ferryman sim``: the real Rust scheduler against a GPU step-time model, to size a deployment and
compare preemption modes without the GPU. ``simulate(gpu(...), model_shape(...), workload,
SimConfig(...))``; ``sweep`` runs it over one knob."""

from ferryman.sim.cost import Roofline
from ferryman.sim.presets import GPUS, MODEL_SHAPES, GpuSpec, ModelShape, gpu, model_shape
from ferryman.sim.simulator import SimConfig, pool_sizes, simulate
from ferryman.sim.sweep import SWEEP_KNOBS, sweep
from ferryman.sim.workload import Workload, from_json, synthetic

__all__ = [
    "GPUS",
    "MODEL_SHAPES",
    "SWEEP_KNOBS",
    "GpuSpec",
    "ModelShape",
    "Roofline",
    "SimConfig",
    "Workload",
    "from_json",
    "gpu",
    "model_shape",
    "pool_sizes",
    "simulate",
    "sweep",
    "synthetic",
]
