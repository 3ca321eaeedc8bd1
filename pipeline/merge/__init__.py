"""The merge library: one function per method over one tensor, rules choosing a method per
tensor, and a streaming driver over safetensors checkpoints. Stands alone: torch and
safetensors only (no import of the data, model or training code)."""

from pipeline.merge.driver import MergeReport, merge_checkpoints, merge_state_dicts, merge_tensor
from pipeline.merge.inputs import TensorInputs, tensor_reader
from pipeline.merge.io import CheckpointReader, MergeInputError
from pipeline.merge.registry import METHODS, MergeMethod, TensorContext, get_method
from pipeline.merge.rules import QWEN2_5_VL_GROUPS, Rule, choose
from pipeline.merge.spec import MergeSpec, MergeSpecError, ModelEntry

__all__ = [
    "METHODS",
    "QWEN2_5_VL_GROUPS",
    "CheckpointReader",
    "MergeInputError",
    "MergeMethod",
    "MergeReport",
    "MergeSpec",
    "MergeSpecError",
    "ModelEntry",
    "Rule",
    "TensorContext",
    "TensorInputs",
    "choose",
    "get_method",
    "merge_checkpoints",
    "merge_state_dicts",
    "merge_tensor",
    "tensor_reader",
]
