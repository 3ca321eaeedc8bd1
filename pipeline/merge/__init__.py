"""The merge library: one function per method over one tensor, rules choosing a method per
tensor, and a streaming driver over safetensors checkpoints. No import of the data or training
code, and of the model code only the model families' declarations: it needs torch, safetensors,
numpy, pydantic, PyYAML and tqdm, three modules of this package (checkpoint, threads, lazy) and
the package ``pipeline.models.families`` (groups, checkpoint layouts), whose family modules import
transformers only inside functions a merge does not call (tiny models, processors, vision
shapes). Exports import their submodule on first use."""

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
