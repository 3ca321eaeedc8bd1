"""This project's model for lmms-eval, registered through lmms-eval's entry-point group
``lmms_eval.models`` (pyproject.toml), so ``python -m lmms_eval --model merit_qwen2_5_vl`` works
too. Only the manifest lives here: lmms-eval reads it while it builds its model registry, and the
model class (``pipeline.eval.lmms_adapted``) is imported when a run asks for it."""

from lmms_eval.models.registry_v2 import ModelManifest

from pipeline.eval.benchmarks import ADAPTED_MODEL

MANIFEST = ModelManifest(model_id=ADAPTED_MODEL, chat_class_path="pipeline.eval.lmms_adapted.AdaptedQwen2_5_VL")
