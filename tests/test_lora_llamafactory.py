"""LLaMA-Factory's LoRA keys mean here what they mean there: its Qwen2.5-VL example resolves to the
modules LLaMA-Factory picks on the tiny model, for each freeze, with the lists written out from
its rules (docs/guides/lora.md, "As in LLaMA-Factory"), not computed by the code under test."""

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from pipeline.config import FreezeSection, ModelSection, TrainSection
from pipeline.models import apply_freeze, build_tiny_model, count_parameters, parameter_groups
from pipeline.models.tiny import tiny_config
from pipeline.train.lora import apply_lora, lora_summary, lora_targets

# The method keys of LLaMA-Factory's examples/train_lora/qwen2_5vl_lora_sft.yaml (v0.9.3, ca75f1e; last
# at 0005269, renamed qwen3_lora_sft.yaml in v0.9.4). The keys it leaves out take LLaMA-Factory's
# defaults (hparams/finetuning_args.py), which are the defaults here.
EXAMPLE = {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"}

# The tiny model's (2 language layers, 2 vision blocks) linear layers by part, lm_head aside.
LANGUAGE = [
    "model.language_model.layers.0.mlp.down_proj",
    "model.language_model.layers.0.mlp.gate_proj",
    "model.language_model.layers.0.mlp.up_proj",
    "model.language_model.layers.0.self_attn.k_proj",
    "model.language_model.layers.0.self_attn.o_proj",
    "model.language_model.layers.0.self_attn.q_proj",
    "model.language_model.layers.0.self_attn.v_proj",
    "model.language_model.layers.1.mlp.down_proj",
    "model.language_model.layers.1.mlp.gate_proj",
    "model.language_model.layers.1.mlp.up_proj",
    "model.language_model.layers.1.self_attn.k_proj",
    "model.language_model.layers.1.self_attn.o_proj",
    "model.language_model.layers.1.self_attn.q_proj",
    "model.language_model.layers.1.self_attn.v_proj",
]
VISION = [
    "model.visual.blocks.0.attn.proj",
    "model.visual.blocks.0.attn.qkv",
    "model.visual.blocks.0.mlp.down_proj",
    "model.visual.blocks.0.mlp.gate_proj",
    "model.visual.blocks.0.mlp.up_proj",
    "model.visual.blocks.1.attn.proj",
    "model.visual.blocks.1.attn.qkv",
    "model.visual.blocks.1.mlp.down_proj",
    "model.visual.blocks.1.mlp.gate_proj",
    "model.visual.blocks.1.mlp.up_proj",
]
PROJECTOR = ["model.visual.merger.mlp.0", "model.visual.merger.mlp.2"]


def frozen_tiny_model(freeze: FreezeSection, tied: bool = True) -> torch.nn.Module:
    if tied:
        model = build_tiny_model(ModelSection(), seed=0)[0]
    else:  # a head of its own, as in the 7B model
        config = tiny_config(ModelSection(), None)
        config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
        model = Qwen2_5_VLForConditionalGeneration(config)
    apply_freeze(model, freeze)
    return model


def test_the_llamafactory_qwen2_5vl_example_adapts_the_modules_llamafactory_picks():
    train, model_cfg = TrainSection(**EXAMPLE), ModelSection()
    assert model_cfg.freeze == FreezeSection(
        freeze_vision_tower=True, freeze_multi_modal_projector=True, freeze_language_model=False
    )
    model = frozen_tiny_model(model_cfg.freeze)
    assert lora_targets(model, train) == LANGUAGE  # no lm_head, no vision block (frozen), no projector
    summary = lora_summary(apply_lora(model, train, base="θ0"))
    assert (summary["rank"], summary["alpha"], summary["modules"]) == (8, 16, LANGUAGE)
    assert summary["modules_to_save"] == [] and train.lora_dropout == 0.0


def test_full_fine_tuning_trains_the_language_model_only_by_default():
    model = frozen_tiny_model(ModelSection().freeze)
    language = {id(p): p for p in parameter_groups(model)["language_model"]}.values()  # tied head counted once
    assert count_parameters(model)["trainable"] == sum(p.numel() for p in language)


# LLaMA-Factory's `all` on Qwen2.5-VL: find_all_linear_modules keeps the last name of every linear
# layer outside lm_head, the projector and (when frozen) the vision tower; patch_target_modules then
# takes every module whose path contains one of them, outside the frozen parts and patch_embed.
@pytest.mark.parametrize(
    "vision, projector, language, expected",
    [
        (True, True, False, LANGUAGE),
        (True, False, False, LANGUAGE),  # the projector: never under `all`
        (False, True, False, sorted(VISION + LANGUAGE)),
        (False, False, False, sorted(VISION + LANGUAGE)),
        (False, True, True, VISION),
        (False, False, True, VISION),
        (True, True, True, None),  # nothing: PEFT's error there, preflight's here
        (True, False, True, None),
    ],
)
def test_all_follows_llamafactory_for_each_freeze(vision, projector, language, expected):
    model = frozen_tiny_model(
        FreezeSection(
            freeze_vision_tower=vision, freeze_multi_modal_projector=projector, freeze_language_model=language
        )
    )
    if expected is None:
        with pytest.raises(ValueError, match="nothing to adapt"):
            lora_targets(model, TrainSection(**EXAMPLE))
    else:
        assert lora_targets(model, TrainSection(**EXAMPLE)) == expected


@pytest.mark.parametrize("projector, expected", [(False, sorted(LANGUAGE + PROJECTOR)), (True, LANGUAGE)])
def test_a_list_naming_the_projector_adapts_it_when_it_trains(projector, expected):
    listed = TrainSection(lora_target="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,mlp.0,mlp.2")
    model = frozen_tiny_model(FreezeSection(freeze_multi_modal_projector=projector))
    assert lora_targets(model, listed) == expected


def test_a_listed_lm_head_is_adapted_unless_it_is_the_embedding_matrix():
    listed = TrainSection(lora_target="lm_head,q_proj")
    expected = ["lm_head", *(n for n in LANGUAGE if n.endswith("q_proj"))]
    assert lora_targets(frozen_tiny_model(FreezeSection(), tied=False), listed) == expected
    with pytest.raises(ValueError, match="lm_head: this model's head is its input embedding matrix"):
        lora_targets(frozen_tiny_model(FreezeSection()), listed)


@pytest.mark.parametrize("rank", [4, 8, 16])
def test_lora_alpha_defaults_to_twice_the_rank(rank):
    assert TrainSection(lora_rank=rank).lora_scaling * rank == 2 * rank
