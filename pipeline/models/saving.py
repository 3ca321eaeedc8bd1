"""Model checkpoints written in the layout of their source, whole or not at all.

A stage that writes a model it trained (the warm-up's θ0, a branch's final weights, a model built offline)
writes the tensors as transformers holds them into the **stored layout** of the checkpoint they came from:
the same tensor names, shapes and expert layout, and the tensors transformers does not load (Qwen3.5's
``mtp.*`` head) copied unchanged from it (``pipeline.merge.layout``). ``save_pretrained`` would instead write
transformers' own layout (Qwen3.5-MoE's experts one by one, Qwen3-VL-MoE's (out, in), the mtp head
dropped; under ZeRO-3 some experts transposed), which no longer merges with its source nor serves as it did.

The tensors are streamed into safetensors shards (``pipeline.merge.io.stream_checkpoint``: one stored tensor
assembled at a time), beside the model's config, generation config and processor, in a folder staged under a
temporary name with a manifest naming the source and the carried tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import source_of, staged_dir, write_manifest
from pipeline.merge.adapter import LM_HEAD, embeddings_tied
from pipeline.merge.io import MergeInputError, TensorInfo, stream_checkpoint
from pipeline.merge.layout import InMemory, Layout, ModelView, assemble, layout_of, restyled

MAX_SHARD = 5 << 30  # bytes per shard, as the hub's checkpoints are cut


def save_model(
    dst: str | Path,
    model: Any,
    layout: Layout,
    carried: Callable[[str], torch.Tensor],
    processor: Any = None,
    state: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = MAX_SHARD,
    **meta: Any,
) -> Path:
    """``state`` (default: ``model``'s own; names as the model holds them) written into ``dst`` in
    ``layout``, its carried tensors as ``carried(name)`` gives them, with ``model``'s config and
    ``processor``; ``meta`` goes into the manifest. Refused, naming the tensors, where ``state`` lacks a
    piece of the layout or holds one it has no place for (a tied lm_head excepted)."""
    state = model.state_dict() if state is None else state
    config = model.config.to_dict()
    held = ModelView(InMemory(state), config)
    missing = [key for key in layout.pieces if key not in held.info]
    tied = embeddings_tied(config)
    extra = [key for key in held.info if key not in layout.pieces and not (tied and key == LM_HEAD)]
    if missing or extra:
        raise MergeInputError(
            f"{dst}: the model's tensors do not fit the layout it is written in: {len(missing)} missing "
            f"{missing[:5]}, {len(extra)} without a place {extra[:5]}; nothing written"
        )
    plan = {
        name: TensorInfo(
            info.shape, held.info[pieces[0].key].dtype if (pieces := layout.in_stored(name)) else info.dtype
        )
        for name, info in layout.stored.items()
    }

    def produce(name: str) -> torch.Tensor:
        if not layout.in_stored(name):
            return carried(name)
        return assemble(layout.in_stored(name), plan[name], lambda piece: held.get(piece.key))

    dtypes = [info.dtype for name, info in plan.items() if layout.in_stored(name) and info.dtype.is_floating_point]
    model.config.dtype = str(dtypes[0]).removeprefix("torch.") if dtypes else model.config.dtype
    model.config.architectures = [type(model).__name__]
    with staged_dir(dst) as tmp:
        written = stream_checkpoint(tmp, plan, produce, max_shard_bytes)
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        write_manifest(tmp, written.sha256, layout=layout.summary(), carried=layout.carried, **meta)
    return Path(dst)


def save_like(
    dst: str | Path,
    model: Any,
    source: str | Path,
    processor: Any = None,
    state: Mapping[str, torch.Tensor] | None = None,
    **meta: Any,
) -> Path:
    """``model`` (or ``state``) written in the stored layout of checkpoint ``source`` (θ0: a branch's start),
    the tensors transformers does not load copied from it; the manifest names the source it must match
    (``source``'s own, where it records one)."""
    theta0 = ModelView.open(source)
    return save_model(
        dst, model, theta0.layout, theta0.files.get, processor, state, source=str(source_of(source)), **meta
    )


def save_as_hub(
    dst: str | Path, model: Any, carried: Mapping[str, torch.Tensor], processor: Any = None, **meta
) -> Path:
    """``model`` written as the hub's checkpoints of its family store it (its spelling of the names, its
    experts' layout, the tied head once), with ``carried`` (tensors transformers does not load)."""
    config = model.config.to_dict()
    held = ModelView(InMemory(model.state_dict()), config)
    loaded = dict(held.loaded())
    if embeddings_tied(config):
        loaded.pop(LM_HEAD, None)
    stored = restyled(loaded, config).stored | {
        name: TensorInfo(tuple(t.shape), t.dtype) for name, t in carried.items()
    }
    return save_model(dst, model, layout_of(stored, config), carried.__getitem__, processor, **meta)
