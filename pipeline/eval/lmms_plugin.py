"""This project's models for lmms-eval, registered through lmms-eval's entry-point group
``lmms_eval.models`` (pyproject.toml), so ``python -m lmms_eval --model merit_qwen2_5_vl`` (or
``merit_qwen3_vl``, ``merit_internvl``) works too, ``--model merit_constant`` (the toy tasks' constant baselines)
and ``--model merit_stored_answers`` (an earlier job's logged answers, judged again).
Only the manifests live here: lmms-eval reads them while it builds its model registry, and a model class
(``pipeline.eval.lmms_adapted``, ``pipeline.eval.constant_model``) is imported when a run asks for it."""

from lmms_eval.models.registry_v2 import ModelManifest

from pipeline.data.benchmark import CONSTANT_MODEL, STORED_MODEL

MANIFEST = ModelManifest(model_id="merit_qwen2_5_vl", chat_class_path="pipeline.eval.lmms_adapted.AdaptedQwen2_5_VL")
QWEN3_MANIFEST = ModelManifest(model_id="merit_qwen3_vl", chat_class_path="pipeline.eval.lmms_adapted.MeritQwen3_VL")
INTERNVL_MANIFEST = ModelManifest(model_id="merit_internvl", chat_class_path="pipeline.eval.lmms_adapted.MeritInternVL")
CONSTANT_MANIFEST = ModelManifest(
    model_id=CONSTANT_MODEL, simple_class_path="pipeline.eval.constant_model.ConstantAnswers"
)
STORED_MANIFEST = ModelManifest(model_id=STORED_MODEL, simple_class_path="pipeline.eval.stored_answers.StoredAnswers")
