"""Tiny models built fully offline, deterministic for a seed: Qwen2.5-VL (``model.name_or_path:
tiny``) or another family (``tiny:<model_type>``, ``pipeline.models.families``).

Real parts throughout: a byte-level BPE tokenizer trained here on the built-in corpus text with
Qwen's pre-tokenizer, special tokens and the family's chat template (``Qwen2Tokenizer``), the
family's real processor (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``) with small pixel bounds, and
a randomly initialised model of the family's own config class, built by ``AutoModelForImageTextToText``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForImageTextToText, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from pipeline.config import ModelSection
from pipeline.data.builtin import corpus_text
from pipeline.models.families import tiny_family

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Text the template itself emits, so that role names and the system prompt tokenize compactly.
TEMPLATE_TEXT = "system\nYou are a helpful assistant.\nuser\nassistant\n"


def train_tokenizer(vocab_size: int, seed: int, named_tokens: dict[str, str] | None = None) -> Qwen2Tokenizer:
    """A BPE tokenizer of ``vocab_size`` learnt on the corpus; ``named_tokens`` are a family's own
    special tokens by the attribute its processor reads (InternVL: ``context_image_token``, …)."""
    named_tokens = named_tokens or {}
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
        **named_tokens,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], *named_tokens.values()]})
    return tokenizer


def build_tiny_processor(model_cfg: ModelSection, seed: int) -> Any:
    family = tiny_family(model_cfg.name_or_path)
    tokenizer = train_tokenizer(model_cfg.tiny.vocab_size, seed, family.special_tokens)
    return family.tiny_processor(model_cfg, tokenizer, family.template())


def tiny_config(model_cfg: ModelSection, tokenizer: Qwen2Tokenizer | None) -> Any:
    """The tiny model's config, of the family ``model.name_or_path`` names; without a tokenizer (a
    skeleton to look at, never to run), the special tokens get placeholder ids."""
    tiny = model_cfg.tiny
    ids = tokenizer.convert_tokens_to_ids if tokenizer is not None else lambda token: 0
    vocab_size = max(len(tokenizer) if tokenizer is not None else tiny.vocab_size, tiny.embedding_rows or 0)
    return tiny_family(model_cfg.name_or_path).tiny_config(tiny, ids, vocab_size)


def build_tiny_model(model_cfg: ModelSection, seed: int) -> tuple[Any, Any]:
    processor = build_tiny_processor(model_cfg, seed)
    config = tiny_config(model_cfg, processor.tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model.eval(), processor
