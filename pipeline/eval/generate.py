"""Exact-match accuracy: greedy answers generated in batches and compared with the references.

A prompt is the conversation up to its last assistant turn, rendered with the chat template's
generation prompt (``<|im_start|>assistant\\n``), its images through the processor as in
training. Prompts are left padded, so every row's answer starts at the same column; images and
text-only prompts share a batch (the model builds each row's 3-D rope positions from its own
tokens under the attention mask).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from typing import Any

import torch

from pipeline.data import Encoder, Example

_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower case, whitespace runs collapsed, end punctuation (. ! ?) and outer spaces stripped:
    "The answer is  Three." and "the answer is three" are the same answer."""
    return _SPACES.sub(" ", text).strip().rstrip(".!?").strip().lower()


def prompt_of(example: Example) -> Example:
    """The example without its last assistant turn (the answer asked for) and what follows it."""
    last = max((i for i, m in enumerate(example.messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise example.error("no assistant turn to generate")
    return replace(example, messages=example.messages[:last], token_ids=None)


class Generator:
    """Greedy answers of a model to examples' prompts: ``(prompt text, answer)`` per example."""

    def __init__(self, model: Any, encoder: Encoder, max_new_tokens: int):
        self.model, self.encoder, self.max_new_tokens = model, encoder, max_new_tokens

    @torch.no_grad()
    def __call__(self, examples: list[Example]) -> list[tuple[str, str]]:
        processor = self.encoder.processor
        texts, images = self.encoder.render([prompt_of(ex) for ex in examples], generation_prompt=True)
        batch = processor(
            text=texts,
            images=list(itertools.chain(*images)) or None,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(self.model.device)
        out = self.model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            # Qwen2.5-VL-Instruct's generation_config.json asks for 1.05, which would bend greedy decoding.
            repetition_penalty=1.0,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
        return [(text, self._decode(row)) for text, row in zip(texts, out[:, batch["input_ids"].shape[1] :])]

    def _decode(self, tokens: torch.Tensor) -> str:
        """The answer's text: up to its first ``<|im_end|>``, special tokens (padding) left out."""
        ends = (tokens == self.encoder.im_end).nonzero()
        if len(ends):
            tokens = tokens[: ends[0, 0]]
        return self.encoder.processor.tokenizer.decode(tokens, skip_special_tokens=True)
