"""Vision-language models: their families (``families``), the offline tiny models, loading real
checkpoints, freezing, θ0. Exports import their submodule on first use, so that the merge library
can read the families' declarations without importing the model code."""

from pipeline.lazy import lazy_exports

EXPORTS = {
    "init_model": "init",
    "processor_for": "init",
    "apply_freeze": "loading",
    "count_parameters": "loading",
    "load_model": "loading",
    "load_processor": "loading",
    "parameter_groups": "loading",
    "build_tiny_model": "tiny",
    "build_tiny_processor": "tiny",
}
__all__ = sorted(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
