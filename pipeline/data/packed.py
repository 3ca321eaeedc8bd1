"""A packed micro batch: encoded examples concatenated into one row with no padding.

Each example keeps what it has alone: its positions (restarting at 0; Qwen's 3-D rows t, h, w as
the model computes them for the example by itself, after a 1-D row the model reads the
boundaries from), its attention (``cu_seq_lens_q``: the language model attends within each
example; the images' own sequences and windows in the vision tower), Qwen3.5's linear-attention
state (``sequence_lengths``), and the positions whose next token is a label (``loss_positions``,
``loss_targets``: the loss gathers them without a boolean mask, so without a host sync). All of it is
computed here, in the loader's workers, so the step itself only runs kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.data.encode import Encoded, supervised_positions
from pipeline.models.families import get_family


class RopeIndex:
    """An example's 3-D positions, by the model class's own ``get_rope_index``, which reads only the
    model's config and its ``get_vision_position_ids``: this object stands in for the model (none
    is built)."""

    def __init__(self, class_name: str, config: Any):
        import transformers

        self.model_class, self.config = getattr(transformers, class_name), config

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model_class.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, enc: Encoded) -> torch.Tensor:
        positions, _ = self.model_class.get_rope_index(
            self, enc.input_ids[None], enc.mm_token_type_ids[None], image_grid_thw=enc.image_grid_thw
        )
        return positions[:, 0]  # (3, T)


class PackedCollator:
    """:class:`Encoded` examples -> one packed row's model inputs (picklable for loader workers)."""

    def __init__(self, config: Any):
        family = get_family(config.model_type, "packed micro batches")
        self.rope = RopeIndex(family.rope_index, config) if family.rope_index else None
        self.vision_inputs = family.vision_inputs
        self.vision_config = getattr(config, "vision_config", None)
        text = getattr(config, "text_config", config)
        self.linear_attention = "linear_attention" in (getattr(text, "layer_types", None) or ())

    def __call__(self, items: list[Encoded]) -> dict[str, Any]:
        lengths = [item.num_tokens for item in items]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        text_positions = torch.cat([torch.arange(n) for n in lengths])[None]
        if self.rope is not None:
            rows = torch.cat([self.rope(item) for item in items], dim=1)[:, None]
            positions = torch.cat([text_positions[None], rows])  # (4, 1, T): the text row, then t, h, w
        else:
            positions = text_positions
        gathered = [supervised_positions(item.labels) for item in items]
        batch: dict[str, Any] = {
            "input_ids": torch.cat([item.input_ids for item in items])[None],
            "position_ids": positions,
            "cu_seq_lens_q": offsets.to(torch.int32),
            "cu_seq_lens_k": offsets.to(torch.int32),
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
            "loss_positions": torch.cat([p + int(o) for (p, _), o in zip(gathered, offsets)]),
            "loss_targets": torch.cat([t for _, t in gathered]),
        }
        if self.linear_attention:
            batch["sequence_lengths"] = tuple(lengths)
        if items[0].mm_token_type_ids is not None:
            batch["mm_token_type_ids"] = torch.cat([item.mm_token_type_ids for item in items])[None]
        with_images = [item for item in items if item.pixel_values is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([item.pixel_values for item in with_images])
            if with_images[0].image_grid_thw is not None:
                grid = torch.cat([item.image_grid_thw for item in with_images])
                batch["image_grid_thw"] = grid
                if self.vision_inputs is not None:
                    inputs = self.vision_inputs(self.vision_config, grid)
                    batch |= {f"image_{name}": value for name, value in inputs.items()}
        return batch
