"""Qwen2.5-VL models: the offline tiny model, loading real checkpoints, freezing, θ0."""

from pipeline.models.init import init_model, processor_for
from pipeline.models.loading import apply_freeze, count_parameters, load_model, load_processor, parameter_groups
from pipeline.models.tiny import build_tiny_model, build_tiny_processor

__all__ = [
    "apply_freeze",
    "build_tiny_model",
    "build_tiny_processor",
    "count_parameters",
    "init_model",
    "load_model",
    "load_processor",
    "parameter_groups",
    "processor_for",
]
