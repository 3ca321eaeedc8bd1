"""Examples -> model inputs: chat template, vision preprocessing, assistant-only labels, batching.

Labels follow Qwen's own fine-tuning code: only assistant turns are learned, from the token
after ``<|im_start|>assistant\\n`` through ``<|im_end|>`` and the newline after it; every other
position is -100 (system prompt, user turns, image tokens, padding).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from qwen_vl_utils import process_vision_info

from pipeline.data.example import DataError, Example

IGNORE_INDEX = -100


@dataclass
class Encoded:
    input_ids: torch.Tensor  # (T,)
    labels: torch.Tensor  # (T,), IGNORE_INDEX outside assistant answers
    mm_token_type_ids: torch.Tensor  # (T,), 1 on image tokens: drives Qwen's 3-D rope index
    pixel_values: torch.Tensor | None  # (patches, C·t·p·p) for all images, in order
    image_grid_thw: torch.Tensor | None  # (images, 3)
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class Encoder:
    """Encodes :class:`Example` with a Qwen-VL processor (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``;
    picklable for DataLoader workers).

    Two paths give identical results. The full path renders the chat template and runs the
    processor (tokenizer + image processor). The cached path, for examples that carry the
    ``token_ids`` written by ``prepare``, skips templating and tokenizing and runs only the
    image processor: the processor's text work is most of the cost on short examples, and
    training must never wait for encoding.
    """

    def __init__(self, processor: Any, max_length: int):
        self.processor, self.max_length = processor, max_length
        tok = processor.tokenizer
        ids = tok.convert_tokens_to_ids
        self.im_start, self.im_end = ids("<|im_start|>"), ids("<|im_end|>")
        self.vision_start, self.vision_end = ids("<|vision_start|>"), ids("<|vision_end|>")
        self.image_token = ids("<|image_pad|>")
        self.merge_area = processor.image_processor.merge_size**2
        self.patch_size = processor.image_processor.patch_size  # 14 for Qwen2.5-VL, 16 for Qwen3-VL
        self.role = tok.encode("assistant", add_special_tokens=False)
        (self.newline,) = tok.encode("\n", add_special_tokens=False)
        self._starts_line: dict[int, bool] = {}
        size = processor.image_processor.size
        self.pixel_bounds = {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}

    def __call__(self, example: Example) -> Encoded:
        return self.encode_batch([example])[0]

    def encode_batch(self, examples: list[Example]) -> list[Encoded]:
        """Encode several examples with one processor call: the per-call overhead dominates
        on small inputs, so batching is what keeps encoding ahead of training."""
        if examples and all(ex.token_ids is not None for ex in examples):
            return self._encode_cached(examples)
        texts, images = self.render(examples)
        try:
            batch = self.processor(
                text=texts, images=list(itertools.chain(*images)) or None, padding=True, return_tensors="pt"
            )
        except (ValueError, OSError) as err:
            if len(examples) == 1:
                raise examples[0].error(f"cannot encode: {err}") from err
            for example in examples:  # find and name the record at fault
                self(example)
            records = [e.index for e in examples]
            raise DataError(examples[0].origin, None, f"records {records} cannot be encoded together: {err}") from err
        rows = [batch["input_ids"][r][batch["attention_mask"][r].bool()] for r in range(len(examples))]
        out = self._assemble(rows, [len(i) for i in images], batch.get("pixel_values"), batch.get("image_grid_thw"))
        return [self._truncate(enc) if enc.num_tokens > self.max_length else enc for enc in out]

    def render(self, examples: list[Example], generation_prompt: bool = False) -> tuple[list[str], list[list[Any]]]:
        """Each example's chat-template text and its images, sized for the processor; with
        ``generation_prompt`` the text ends in the assistant header that asks for a reply."""
        messages = [self._with_images(ex) for ex in examples]
        texts = [
            self.processor.apply_chat_template(m, tokenize=False, add_generation_prompt=generation_prompt)
            for m in messages
        ]
        return texts, [self.images(m) for m in messages]

    def images(self, messages: list[dict[str, Any]]) -> list[Any]:
        """The messages' images resized as the processor's patches want them."""
        return process_vision_info(messages, image_patch_size=self.patch_size)[0] or []

    def _encode_cached(self, examples: list[Example]) -> list[Encoded]:
        rows = [ex.token_ids.long() for ex in examples]
        # Truncation drops whole images, so the images kept are the first <|vision_start|> many.
        kept = [int((ids == self.vision_start).sum()) for ids in rows]
        images = [self.images(self._with_images(ex))[:k] for ex, k in zip(examples, kept)]
        flat = list(itertools.chain(*images))
        vision = self.processor.image_processor(flat, return_tensors="pt") if flat else {}
        out = self._assemble(rows, kept, vision.get("pixel_values"), vision.get("image_grid_thw"))
        for ex, enc in zip(examples, out):
            patches = 0 if enc.image_grid_thw is None else int(enc.image_grid_thw.prod(-1).sum())
            if int((enc.input_ids == self.image_token).sum()) * self.merge_area != patches:
                raise ex.error("cached token ids do not match the images; re-run `merit prepare --force`")
        return out

    def _assemble(
        self,
        rows: list[torch.Tensor],
        n_images: list[int],
        pixel_values: torch.Tensor | None,
        grids: torch.Tensor | None,
    ) -> list[Encoded]:
        """Per-example :class:`Encoded` from token rows and the batch's concatenated images."""
        patches = grids.prod(-1).tolist() if grids is not None else []
        out, first_image, first_patch = [], 0, 0
        for input_ids, n in zip(rows, n_images):
            n_patches = sum(patches[first_image : first_image + n])
            out.append(
                Encoded(
                    input_ids=input_ids,
                    labels=self.assistant_labels(input_ids),
                    mm_token_type_ids=(input_ids == self.image_token).long(),
                    pixel_values=pixel_values[first_patch : first_patch + n_patches] if n else None,
                    image_grid_thw=grids[first_image : first_image + n] if n else None,
                    truncated=False,
                )
            )
            first_image, first_patch = first_image + n, first_patch + n_patches
        return out

    def _with_images(self, example: Example) -> list[dict[str, Any]]:
        images = iter(example.load_images())
        messages = []
        for message in example.messages:
            content = [
                {"type": "image", "image": next(images), **self.pixel_bounds} if item["type"] == "image" else item
                for item in message["content"]
            ]
            messages.append({"role": message["role"], "content": content})
        return messages

    def _is_line_break(self, token: int) -> bool:
        """Whether a token starts with a newline: the header's "\n" may merge with an answer's
        leading newlines into one token ("\n\n" is a single token in Qwen's vocabulary)."""
        if token not in self._starts_line:
            self._starts_line[token] = self.processor.tokenizer.decode([token]).startswith("\n")
        return self._starts_line[token]

    def assistant_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        ids = input_ids.tolist()
        after_role = 1 + len(self.role)
        for start in (input_ids == self.im_start).nonzero().flatten().tolist():
            header_end = start + after_role
            if (
                ids[start + 1 : header_end] != self.role
                or header_end >= len(ids)
                or not self._is_line_break(ids[header_end])
            ):
                continue
            first = header_end + 1
            end = first
            while end < len(ids) and ids[end] != self.im_end:
                end += 1
            end += 1  # through <|im_end|> ...
            if end < len(ids) and ids[end] == self.newline:
                end += 1  # ... and the newline after it
            labels[first:end] = input_ids[first:end]
        return labels

    def _truncate(self, enc: Encoded) -> Encoded:
        """Cut to ``max_length`` from the right without splitting an image: an image whose
        tokens would be cut is dropped whole, with its pixel rows, so the model never sees a
        number of image tokens that differs from its image features."""
        cut = self.max_length
        starts = (enc.input_ids == self.vision_start).nonzero().flatten().tolist()
        ends = (enc.input_ids == self.vision_end).nonzero().flatten().tolist()
        kept_images = 0
        for s, e in zip(starts, ends):
            if e < cut:
                kept_images += 1
            else:
                cut = min(cut, s)
                break
        pixel_values, grid = enc.pixel_values, enc.image_grid_thw
        if grid is not None:
            grid = grid[:kept_images]
            pixel_values = pixel_values[: int(grid.prod(-1).sum())]
            if kept_images == 0:
                pixel_values = grid = None
        return Encoded(
            input_ids=enc.input_ids[:cut],
            labels=enc.labels[:cut],
            mm_token_type_ids=enc.mm_token_type_ids[:cut],
            pixel_values=pixel_values,
            image_grid_thw=grid,
            truncated=True,
        )


class Collator:
    """Pads a list of :class:`Encoded` (right padding) and concatenates the image tensors of
    the examples that have images, so image and text-only examples share a batch."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, items: list[Encoded]) -> dict[str, torch.Tensor]:
        length = max(item.num_tokens for item in items)

        def pad(name: str, value: int) -> torch.Tensor:
            out = torch.full((len(items), length), value, dtype=torch.long)
            for row, item in enumerate(items):
                seq = getattr(item, name)
                out[row, : seq.numel()] = seq
            return out

        batch = {
            "input_ids": pad("input_ids", self.pad_token_id),
            "labels": pad("labels", IGNORE_INDEX),
            "mm_token_type_ids": pad("mm_token_type_ids", 0),
            "attention_mask": torch.zeros(len(items), length, dtype=torch.long),
        }
        for row, item in enumerate(items):
            batch["attention_mask"][row, : item.num_tokens] = 1
        with_images = [item for item in items if item.image_grid_thw is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([item.pixel_values for item in with_images])
            batch["image_grid_thw"] = torch.cat([item.image_grid_thw for item in with_images])
        return batch


class EncodedDataset(torch.utils.data.Dataset):
    """Lazily encoded examples, for a ``DataLoader`` (encoding runs in its workers)."""

    def __init__(self, examples: list[Example], encoder: Encoder):
        self.examples, self.encoder = examples, encoder

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Encoded:
        return self.encoder(self.examples[i])

    def __getitems__(self, indices: list[int]) -> list[Encoded]:
        # DataLoader fetches a whole batch through this hook: one processor call per batch.
        return self.encoder.encode_batch([self.examples[i] for i in indices])
