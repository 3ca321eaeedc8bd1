"""Examples -> model inputs: chat template, vision preprocessing, assistant-only labels, batching.

Labels follow Qwen's own fine-tuning code: only assistant turns are learned, from the token
after ``<|im_start|>assistant\\n`` through ``<|im_end|>`` and the newline after it; every other
position is -100 (system prompt, user turns, image tokens, padding). Every supported family speaks
this ChatML format; they differ in how an image becomes tokens and pixel rows (:class:`ImageTokens`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from qwen_vl_utils import process_vision_info
from qwen_vl_utils.vision_process import SPATIAL_MERGE_SIZE, smart_resize

from pipeline.data.example import DataError, Example

IGNORE_INDEX = -100


@dataclass
class Encoded:
    input_ids: torch.Tensor  # (T,)
    labels: torch.Tensor  # (T,), IGNORE_INDEX outside assistant answers
    mm_token_type_ids: torch.Tensor | None  # (T,), 1 on image tokens: drives Qwen's 3-D rope index
    pixel_values: torch.Tensor | None  # (rows, …) for all images, in order: patches (Qwen), tiles (InternVL)
    image_grid_thw: torch.Tensor | None  # (images, 3), Qwen only
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class ImageTokens:
    """How a family's processor lays an image out: a run of ``token`` between ``start`` and ``end``
    in the text, and ``rows_per_token`` rows of ``pixel_values`` per ``token``."""

    token: int
    start: int
    end: int
    rows_per_token: Fraction  # Qwen: merge² patches per token; InternVL: one tile per image_seq_length tokens
    patch_size: int | None  # Qwen: images resized to multiples of it first; None: the processor tiles them
    grids: bool  # Qwen: the model takes image_grid_thw and mm_token_type_ids

    def rows(self, input_ids: torch.Tensor) -> int:
        """Rows of ``pixel_values`` the images of a token sequence take."""
        return int(int((input_ids == self.token).sum()) * self.rows_per_token)


def image_tokens(processor: Any) -> ImageTokens:
    images, ids = processor.image_processor, processor.tokenizer.convert_tokens_to_ids
    if hasattr(images, "merge_size"):  # Qwen-VL: patches, merge_size² of them per token
        start, end, per_token = ids("<|vision_start|>"), ids("<|vision_end|>"), Fraction(images.merge_size**2)
        return ImageTokens(processor.image_token_id, start, end, per_token, images.patch_size, True)
    # InternVL: tiles of image_seq_length tokens each
    start, end = processor.start_image_token_id, processor.end_image_token_id
    return ImageTokens(processor.image_token_id, start, end, Fraction(1, processor.image_seq_length), None, False)


class Encoder:
    """Encodes :class:`Example` with a family's processor (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``,
    ``InternVLProcessor``; picklable for DataLoader workers).

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
        self.vision = image_tokens(processor)
        self.role = tok.encode("assistant", add_special_tokens=False)
        (self.newline,) = tok.encode("\n", add_special_tokens=False)
        self._starts_line: dict[int, bool] = {}
        size = processor.image_processor.size
        self.pixel_bounds = (
            {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]} if self.vision.grids else {}
        )
        # The processor's own defaults for images (InternVL: crop_to_patches), for the cached path's
        # direct call of the image processor.
        self.image_kwargs = getattr(type(processor), "images_kwargs", None) or {}

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

    def encode_counted(self, examples: list[Example]) -> list[Encoded]:
        """What :meth:`encode_batch` gives without its pixels: the same token ids, labels and
        truncation, from each image's size alone (read from its header). The tokens an image takes
        are the processor's own count (transformers' ``_get_num_multimodal_tokens``: its image
        processor's resize arithmetic) of the image as the full path sizes it (qwen-vl-utils'
        resize first, for a Qwen family), spelled out by the processor's own
        ``replace_image_token``: no image is decoded, resized or cut into patches. What ``prepare``
        runs: it keeps only the ids."""
        texts = self.processor.apply_chat_template(
            [ex.messages for ex in examples], tokenize=False, add_generation_prompt=False
        )
        sizes = [self._as_resized(ex, *size) for ex in examples for size in ex.image_sizes()]
        if sizes:
            counted = self.processor._get_num_multimodal_tokens(image_sizes=sizes)
            patches = [int(n) for n in counted.num_image_patches]
            laid_out = {"image_grid_thw": torch.tensor([[1, 1, n] for n in patches]), "num_patches": patches}
            images = [self.processor.replace_image_token(laid_out, image_idx=i) for i in range(len(patches))]
            texts = self.processor.get_text_with_replacements(texts, images, [], [])[0]
        rows = [torch.tensor(ids) for ids in self.processor.tokenizer(texts)["input_ids"]]
        out = []
        for input_ids in rows:
            grid = (input_ids == self.vision.token).long() if self.vision.grids else None
            enc = Encoded(input_ids, self.assistant_labels(input_ids), grid, None, None, truncated=False)
            out.append(self._truncate(enc) if enc.num_tokens > self.max_length else enc)
        return out

    def _as_resized(self, example: Example, width: int, height: int) -> tuple[int, int]:
        """(height, width) of an image as the full path hands it to the processor: resized by
        qwen-vl-utils to the patch grid and pixel bounds for a Qwen family, as it is otherwise.
        An image so thin that the resize leaves no row or column is refused, as the full path's
        resize refuses it."""
        if self.vision.patch_size is None:
            return height, width
        factor = self.vision.patch_size * SPATIAL_MERGE_SIZE
        try:
            resized = smart_resize(height, width, factor=factor, **self.pixel_bounds)
        except ValueError as err:  # qwen-vl-utils' limit on the aspect ratio
            raise example.error(f"cannot encode: {err}") from err
        if min(resized) == 0:
            raise example.error(f"cannot encode: an image of {width}×{height} resizes to {resized[1]}×{resized[0]}")
        return resized

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
        """The messages' images: resized as the processor's patches want them (Qwen), or as they are
        for a processor that tiles them itself (InternVL)."""
        if self.vision.patch_size is not None:
            return process_vision_info(messages, image_patch_size=self.vision.patch_size)[0] or []
        return [c["image"].convert("RGB") for m in messages for c in m["content"] if c["type"] == "image"]

    def _encode_cached(self, examples: list[Example]) -> list[Encoded]:
        rows = [ex.token_ids.long() for ex in examples]
        # Truncation drops whole images, so the images kept are the first as many as open in the text.
        kept = [int((ids == self.vision.start).sum()) for ids in rows]
        images = [self.images(self._with_images(ex))[:k] for ex, k in zip(examples, kept)]
        flat = list(itertools.chain(*images))
        vision = self.processor.image_processor(flat, return_tensors="pt", **self.image_kwargs) if flat else {}
        image_rows = iter(self._rows_per_image(vision))
        for ex, ids, k in zip(examples, rows, kept):
            if sum(itertools.islice(image_rows, k)) != self.vision.rows(ids):
                raise ex.error("cached token ids do not match the images; re-run `merit prepare --force`")
        return self._assemble(rows, kept, vision.get("pixel_values"), vision.get("image_grid_thw"))

    @staticmethod
    def _rows_per_image(vision: dict[str, Any]) -> list[int]:
        """Rows of ``pixel_values`` per image, as the image processor returned them."""
        if "image_grid_thw" in vision:
            return vision["image_grid_thw"].prod(-1).tolist()
        return [int(n) for n in vision.get("num_patches", [])]

    def _assemble(
        self,
        rows: list[torch.Tensor],
        n_images: list[int],
        pixel_values: torch.Tensor | None,
        grids: torch.Tensor | None,
    ) -> list[Encoded]:
        """Per-example :class:`Encoded` from token rows and the batch's concatenated images."""
        out, first_image, first_row = [], 0, 0
        for input_ids, n in zip(rows, n_images):
            n_rows = self.vision.rows(input_ids)
            out.append(
                Encoded(
                    input_ids=input_ids,
                    labels=self.assistant_labels(input_ids),
                    mm_token_type_ids=(input_ids == self.vision.token).long() if self.vision.grids else None,
                    pixel_values=pixel_values[first_row : first_row + n_rows] if n else None,
                    image_grid_thw=grids[first_image : first_image + n] if n and grids is not None else None,
                    truncated=False,
                )
            )
            first_image, first_row = first_image + n, first_row + n_rows
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
        starts = (enc.input_ids == self.vision.start).nonzero().flatten().tolist()
        ends = (enc.input_ids == self.vision.end).nonzero().flatten().tolist()
        kept_images = 0
        for s, e in zip(starts, ends):
            if e < cut:
                kept_images += 1
            else:
                cut = min(cut, s)
                break
        pixel_values, grid = enc.pixel_values, enc.image_grid_thw
        if pixel_values is not None:
            pixel_values = pixel_values[: self.vision.rows(enc.input_ids[:cut])] if kept_images else None
            grid = grid[:kept_images] if grid is not None and kept_images else None
        return Encoded(
            input_ids=enc.input_ids[:cut],
            labels=enc.labels[:cut],
            mm_token_type_ids=enc.mm_token_type_ids[:cut] if enc.mm_token_type_ids is not None else None,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            truncated=True,
        )


def supervised_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of a sequence whose next token carries a label, and those labels: position t
    predicts token t + 1, as in the model's own shifted loss."""
    following = labels[1:]
    positions = (following != IGNORE_INDEX).nonzero().flatten()
    return positions, following[positions]


class Collator:
    """Pads a list of :class:`Encoded` (right padding) and concatenates the image tensors of
    the examples that have images, so image and text-only examples share a batch. The supervised
    positions are gathered as indices into the flattened (rows × length) hidden states."""

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
            "attention_mask": torch.zeros(len(items), length, dtype=torch.long),
        }
        if items[0].mm_token_type_ids is not None:
            batch["mm_token_type_ids"] = pad("mm_token_type_ids", 0)
        for row, item in enumerate(items):
            batch["attention_mask"][row, : item.num_tokens] = 1
        gathered = [supervised_positions(item.labels) for item in items]
        batch["loss_positions"] = torch.cat([p + row * length for row, (p, _) in enumerate(gathered)])
        batch["loss_targets"] = torch.cat([t for _, t in gathered])
        with_images = [item for item in items if item.pixel_values is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([item.pixel_values for item in with_images])
            if with_images[0].image_grid_thw is not None:
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
