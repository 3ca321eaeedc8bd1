"""A tiny Qwen2.5-VL built fully offline, deterministic for a seed.

Real parts throughout: a byte-level BPE tokenizer trained here on the built-in corpus text with
Qwen's pre-tokenizer, special tokens and chat template (``Qwen2Tokenizer``), the real
``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` with small pixel bounds, wrapped in a real
``Qwen2_5_VLProcessor``, and a randomly initialised ``Qwen2_5_VLForConditionalGeneration``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

from pipeline.config import ModelSection, TinyModelSection
from pipeline.data.builtin import corpus_text
from pipeline.models.loading import pixel_bounds

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CHAT_TEMPLATE = (Path(__file__).parent / "qwen2_5_vl_chat_template.jinja").read_text()
# Text the template itself emits, so that role names and the system prompt tokenize compactly.
TEMPLATE_TEXT = "system\nYou are a helpful assistant.\nuser\nassistant\n"


def train_tokenizer(vocab_size: int, seed: int) -> Qwen2Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    bpe.train_from_iterator([TEMPLATE_TEXT, *corpus_text(seed)], trainer)
    trained = json.loads(bpe.to_str())["model"]
    # eos and pad as in Qwen2.5-VL-Instruct: a chat turn ends at <|im_end|> (lmms-eval stops there)
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m) for m in trained["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def build_tiny_processor(model_cfg: ModelSection, seed: int) -> Qwen2_5_VLProcessor:
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixel_bounds(model_cfg)),
        video_processor=Qwen2VLVideoProcessor(size=pixel_bounds(model_cfg)),
        tokenizer=train_tokenizer(model_cfg.tiny.vocab_size, seed),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(tiny: TinyModelSection, tokenizer: Qwen2Tokenizer | None) -> Qwen2_5_VLConfig:
    """The tiny model's config; without a tokenizer (a skeleton to look at, never to run), the
    special tokens get placeholder ids."""
    ids = tokenizer.convert_tokens_to_ids if tokenizer is not None else lambda token: 0
    half_head = tiny.hidden_size // tiny.num_heads // 2
    # Qwen's 3-D rope splits each head's rotary half into (time, height, width) sections.
    mrope = [half_head // 4, (half_head - half_head // 4) // 2]
    mrope.append(half_head - sum(mrope))
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": max(len(tokenizer) if tokenizer is not None else tiny.vocab_size, tiny.embedding_rows or 0),
            "hidden_size": tiny.hidden_size,
            "intermediate_size": tiny.intermediate_size,
            "num_hidden_layers": tiny.num_layers,
            "num_attention_heads": tiny.num_heads,
            "num_key_value_heads": tiny.num_kv_heads,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": tiny.vision_depth,
            "hidden_size": tiny.vision_hidden_size,
            "intermediate_size": tiny.vision_intermediate_size,
            "num_heads": tiny.vision_heads,
            "out_hidden_size": tiny.hidden_size,
            "window_size": tiny.vision_window,
            # Qwen2.5-VL: every 8th block attends to the whole image, the others to windows.
            "fullatt_block_indexes": list(range(7, tiny.vision_depth, 8)) or [tiny.vision_depth - 1],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def build_tiny_model(
    model_cfg: ModelSection, seed: int
) -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor]:
    processor = build_tiny_processor(model_cfg, seed)
    config = tiny_config(model_cfg.tiny, processor.tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model.eval(), processor
