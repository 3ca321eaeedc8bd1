"""The merge library: one function per method over one tensor, rules choosing a method per
tensor, and a streaming driver over safetensors checkpoints. Stands alone: no import of the
data, model or training code; it needs torch, safetensors, numpy, pydantic, PyYAML and tqdm, and
four small modules of this package (checkpoint, threads, lazy, and the model families' declarations,
``pipeline.models.families``: names, no model code). Exports import their submodule
on first use."""

from pipeline.lazy import lazy_exports

EXPORTS = {
    "MergeReport": "driver",
    "merge_checkpoints": "driver",
    "merge_state_dicts": "driver",
    "merge_tensor": "driver",
    "TensorInputs": "inputs",
    "tensor_reader": "inputs",
    "CheckpointReader": "io",
    "MergeInputError": "io",
    "METHODS": "registry",
    "ModelView": "layout",
    "MergeMethod": "registry",
    "TensorContext": "registry",
    "get_method": "registry",
    "groups": "rules",
    "Rule": "rules",
    "choose": "rules",
    "MergeSpec": "spec",
    "MergeSpecError": "spec",
    "ModelEntry": "spec",
}
__all__ = sorted(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
