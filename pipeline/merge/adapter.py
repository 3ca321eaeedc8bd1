"""LoRA adapters as merge inputs: what a PEFT adapter does to each tensor of θ0, formed the way PEFT 0.21's
``merge_and_unload`` changes that tensor, so a merge of adapters is the same merge of PEFT's merged models.

Per module, an adapter folder holds (PEFT's rule in brackets):

- ``lora_A`` (r × in) and ``lora_B`` (out × r): τ = s·B A [``Linear.merge``]; for a Conv3d (the vision patch
  embedding) the same product over the flattened kernel [``_ConvNd.get_delta_weight``]; for an embedding,
  ``lora_embedding_A`` (r × vocab) and ``lora_embedding_B`` (dim × r), τ = s·(B A)ᵀ [``Embedding``]. The scaling
  s = alpha / r (``use_rslora``: alpha / √r), r and alpha per module from ``rank_pattern`` / ``alpha_pattern``
  with PEFT's matching, a missing ``r`` or ``lora_alpha`` PEFT's default 8; A's rank must be the config's.
  ``fan_in_fan_out`` is ignored, as PEFT ignores it on the linear layers of the supported models.
- ``lora_B.bias`` (``lora_bias``): τ of the module's bias = s·b; refused where θ0's module has no bias (PEFT's
  merge raises there).
- Tensors stored whole replace θ0's value: ``modules_to_save`` tensors, biases (``bias: all | lora_only``: a
  plain ``<m>.bias`` or ``<m>.base_layer.bias``) and an embedding LoRA's saved base (``<m>.base_layer.weight``),
  plus τ where the module also has factors.
- ``token_adapter.trainable_tokens_delta`` (``trainable_token_indices``): new values of those rows.
- LoRA on a mixture of experts' fused expert tensors (``target_parameters``: ``mlp.experts.gate_up_proj``,
  ``mlp.experts.down_proj``; PEFT's ``ParamWrapper``, nested ``…experts.base_layer.lora_A`` where it adapts
  both): A (r·E × in), B (out × r·E), expert e's τ = s·B[:, e::E] A[e·r:(e+1)·r] [``ParamWrapper.
  get_delta_weight``], formed for each expert's gate, up and down matrix apart, the pieces every merge method
  combines (``pipeline.merge.layout``). Which parameter a factor pair adapts is read from its shapes.

τ is formed row block by row block (rows of B times the whole A, which is small), so a merge holds one block of
ΔW, never A and B apart: every method of the library combines ΔW. A tensor the adapter does not touch has τ = 0.

**Tied embeddings.** On a θ0 whose ``lm_head`` is its embedding (``tie_word_embeddings``, stored once), PEFT's
changes to either land on the one shared matrix, except where it unties them: ``modules_to_save`` with
``lm_head`` or the embedding and no ``ensure_weight_tying`` gives the saved module its own copy, and
``merge_and_unload`` then sets ``tie_word_embeddings: false``. Such an adapter ``unties``: its ``lm_head.weight``
is a tensor of its own (θ0's embedding plus what the adapter does to ``lm_head``), and the merge is written
untied (``pipeline.merge.driver``). Two changes to the shared matrix (LoRA on both ``embed_tokens`` and
``lm_head``, on which PEFT's merge adds both, or twice with ``ensure_weight_tying``) are refused.

**Refused**, naming the option: options whose merged weight is not θ0 plus such a τ (DoRA, KaSA, BD-LoRA) or
that PEFT cannot merge (Arrow, aLoRA, QA-LoRA, ``layer_replication``, ``target_parameters`` other than 2-D
weights and fused experts), and
the initialisations that train from a changed base (PiSSA, OLoRA, CorDA, LoRA-GA: convert them first; LoftQ
cannot be converted).

The adapter names modules as the model's Python modules (``model.language_model.layers.0…``), θ0 is read
through its :class:`~pipeline.merge.layout.ModelView`, whose keys are those names whatever θ0's files call
them (Qwen2.5-VL's ``model.layers.0…``, InternVL's ``language_model.model.layers.0…``); an adapter saved
under an older module spelling (transformers 4's ``model.layers.0…``) is read through the family's
``stored_as`` pairs too. (PEFT 0.21 itself does not map an adapter saved in the transformers-4 layout and
merges nothing of it; ``pipeline.models.adapter`` passes it the mapping.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline.merge.io import DTYPES, MergeInputError
from pipeline.merge.layout import ModelView

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.language_model.embed_tokens.weight"  # as the module spells it
PEFT_DEFAULT_RANK = PEFT_DEFAULT_ALPHA = 8  # LoraConfig's r and lora_alpha when adapter_config.json omits them

CONVERT = (
    "convert it first: PEFT's save_pretrained(out, path_initial_model_for_weight_conversion=<the adapter saved "
    "before training>) writes an adapter over θ0 (init_lora_weights: true)"
)
# init_lora_weights values that train from a base PEFT changed (θ0 − s·B0 A0), with what to do about it
CHANGED_BASE_INITS = {
    "pissa": f"PiSSA trains from θ0 minus its top singular directions; {CONVERT}",
    "olora": f"OLoRA trains from θ0 minus its QR directions; {CONVERT}",
    "corda": f"CorDA trains from θ0 minus its covariance directions; {CONVERT}",
    "lora_ga": f"LoRA-GA trains from θ0 minus its gradient directions; {CONVERT}",
    "loftq": "LoftQ trains over a quantised θ0, and PEFT cannot convert it to an adapter over θ0",
}
# adapter_config.json options whose merged weight is not θ0 + s·B A, or that PEFT cannot merge
REFUSED_OPTIONS = {
    "use_dora": "DoRA rescales every row of θ0 + s·B A, so ΔW is not low-rank; merge PEFT's merged model instead",
    "kasa_config": "KaSA truncates θ0's SVD and scales B diag(lora_diag) A",
    "use_bdlora": "BD-LoRA stores block-diagonal factors",
    "arrow_config": "Arrow routes among adapters token by token; PEFT cannot merge it",
    "alora_invocation_tokens": "aLoRA applies only after its invocation tokens; PEFT cannot merge it",
    "use_qalora": "QA-LoRA adapts GPTQ layers; PEFT cannot merge it",
    "layer_replication": "layer_replication builds layers θ0 does not have",
}
# Buffers of variants whose merge is plain s·B A (VeLoRA's projection, MonteCLoRA's sampler): not part of ΔW.
IGNORED = (".lora_velora_", ".lora_monteclora_")
# A stored key's suffix -> the parameter of its module that it changes
CHANGED_PARAMETER = {
    ".lora_A.weight": "weight",
    ".lora_embedding_A": "weight",
    ".lora_B.bias": "bias",
    ".token_adapter.trainable_tokens_delta": "weight",
}


def embeddings_tied(config: dict) -> bool:
    """Whether a model's config ties lm_head to the embedding (transformers 5: at the top; 4: in text_config)."""
    return bool(config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings"))


def untied_config(config: dict) -> dict:
    """A model's config with lm_head and the embedding untied, as PEFT's merge_and_unload leaves it."""
    config = config | {"tie_word_embeddings": False}
    if "text_config" in config:
        config["text_config"] = config["text_config"] | {"tie_word_embeddings": False}
    return config


class AdapterError(MergeInputError):
    """An adapter folder that cannot be used; the message names the file at fault."""


def read_adapter_config(path: str | Path) -> dict:
    """A LoRA adapter's adapter_config.json, after checking its weights are safetensors (PEFT
    falls back to a pickled ``adapter_model.bin``, which is refused)."""
    path = Path(path)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{path}: no {ADAPTER_WEIGHTS} (adapters are read from safetensors only, never pickle)")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise AdapterError(f"{path / ADAPTER_CONFIG}: cannot read the adapter's config ({err})") from err
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: a {config.get('peft_type')} adapter; only LoRA adapters are read")
    return config


def check_mergeable(config: dict, path: Path) -> None:
    """Refuse, naming the option, an adapter whose merged weight is not θ0 plus what this module forms."""
    where = path / ADAPTER_CONFIG
    for option, why in REFUSED_OPTIONS.items():
        if config.get(option):
            raise AdapterError(f"{where}: {option} is set: {why}")
    init = config.get("init_lora_weights", True)
    # PEFT reads "pissa_niter_<k>" and "corda…" as prefixes
    if isinstance(init, str) and (kind := next((k for k in CHANGED_BASE_INITS if init.lower().startswith(k)), None)):
        raise AdapterError(f"{where}: init_lora_weights {init!r}: {CHANGED_BASE_INITS[kind]}")
    experts = tuple(f".{proj}" for proj in EXPERT_PARAMETERS)
    if bad := [p for p in config.get("target_parameters") or [] if not p.endswith((".weight", *experts))]:
        raise AdapterError(
            f"{where}: target_parameters {bad}: only 2-D .weight parameters and fused experts "
            f"({', '.join(EXPERT_PARAMETERS)}) are merged"
        )


def pattern_key(patterns: dict, module: str) -> str | None:
    """PEFT's rank_pattern / alpha_pattern matching (``peft.utils.other.get_pattern_key``, copied so the merge
    library needs no PEFT): the first key, in the file's order, that matches the end of the module's path."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)


def _module_tensor(key: str) -> str:
    """A stored key as the model's tensor name (older PEFT saved ``<m>.modules_to_save.<p>``)."""
    return key.removeprefix(PEFT_PREFIX).replace(".modules_to_save.", ".")


def adapted_parameters(path: str | Path) -> set[str]:
    """The model's parameter names (as its modules spell them) that an adapter changes."""
    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as file:
        keys = list(file.keys())
    names = set()
    for key in keys:
        inner = _module_tensor(key)
        if suffix := next((s for s in CHANGED_PARAMETER if inner.endswith(s)), None):
            names.add(f"{inner.removesuffix(suffix)}.{CHANGED_PARAMETER[suffix]}")
        elif ".lora_" not in inner:
            names.add(inner.replace(".base_layer.", "."))
    return names


EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # a fused experts module's 3-D parameters


@dataclass(frozen=True)
class ExpertSlice:
    """Where one expert's matrix is in a ``ParamWrapper``'s factors: A's rows [e·r, (e+1)·r), B's columns
    e, e + E, …, and B's rows from ``row`` on (the up half of ``gate_up_proj`` starts at inter)."""

    expert: int
    experts: int
    rank: int
    row: int = 0


@dataclass(frozen=True)
class LoraFactors:
    """One module's LoRA factors on a θ0 tensor: τ = scaling · B A (flattened for a conv), or scaling · (B A)ᵀ
    for an embedding's ``lora_embedding_A`` / ``_B``, or one expert's slice of them."""

    module: str  # the adapted module's path, as the adapter spells it
    a: str  # key of A
    b: str  # key of B
    scaling: float
    embedding: bool = False
    expert: ExpertSlice | None = None


class AdapterReader:
    """An adapter over θ0 with a :class:`~pipeline.merge.layout.ModelView`'s interface (θ0's keys and
    shapes, rows on demand): ``reader(key)`` gives rows of τ where ``is_delta(key)``, else rows of the model's
    tensor."""

    def __init__(self, path: str | Path, base: ModelView):
        self.path, self.base = Path(path), base
        self.adapter_config = read_adapter_config(self.path)
        check_mergeable(self.adapter_config, self.path)
        try:
            self._file = safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt", device="cpu")
            keys = list(self._file.keys())
        except (SafetensorError, OSError) as err:
            raise MergeInputError(f"{self.path / ADAPTER_WEIGHTS}: cannot read safetensors ({err})") from err
        self.info, self.loaded = base.info, base.loaded()
        self.factors: dict[str, LoraFactors] = {}  # θ0's tensor name -> its module's factors
        self.bias: dict[str, tuple[str, float]] = {}  # θ0's bias name -> (lora_B.bias key, scaling)
        self.whole: dict[str, str] = {}  # θ0's tensor name -> key of the value stored whole
        self.tokens: dict[str, tuple[str, list[int]]] = {}  # θ0's tensor name -> (key, rows) of trainable tokens
        self.module_tensor: dict[str, str] = {}  # θ0's tensor name -> the adapter's spelling of it
        self.embedding = EMBEDDING if embeddings_tied(base.config()) and EMBEDDING in self.info else None
        self.unties = self.embedding is not None and self._unties(keys)
        for key in self._keys(keys):
            self._index(key, set(keys))
        self._cached: tuple[str, torch.Tensor] | None = None  # the last tensor's A (B for an embedding)

    def key(self, module_tensor: str) -> str | None:
        """θ0's key of a module's tensor as the adapter names it, None where θ0 has no such tensor."""
        key = self.base.key(module_tensor)
        return key if key in self.info else None

    def _unties(self, keys: list[str]) -> bool:
        """Whether PEFT's merge unties θ0's lm_head from the embedding: one of them is a module to save
        (``modules_to_save``: a copy of its own) and ``ensure_weight_tying`` does not keep them one."""
        whole = {_module_tensor(k) for k in keys if ".lora_" not in k and ".base_layer." not in k}
        saved = LM_HEAD in whole or any(self.key(t) == self.embedding for t in whole)
        return saved and not self.adapter_config.get("ensure_weight_tying")

    def _keys(self, keys: list[str]) -> list[str]:
        """The keys to index: with ``ensure_weight_tying`` lm_head's saved copy is the embedding's (one
        Parameter, saved under both names): it is read once, as the embedding."""
        if self.embedding is None or self.unties:
            return keys
        tensors = {_module_tensor(k) for k in keys}
        if any(self.key(t) == self.embedding for t in tensors):
            return [k for k in keys if _module_tensor(k) != LM_HEAD]
        return keys

    def _index(self, key: str, keys: set[str]) -> None:
        inner = _module_tensor(key)
        if any(marker in inner for marker in IGNORED) or inner.endswith((".lora_B.weight", ".lora_embedding_B")):
            return  # B is read with its A
        if ".lora_magnitude_vector" in inner:
            raise AdapterError(f"{self.path}: {key} is a DoRA magnitude: {REFUSED_OPTIONS['use_dora']}")
        if inner.endswith(".lora_A.weight") and (experts := self._experts_module(inner)) is not None:
            self._index_experts(key, experts, keys)
        elif ".base_layer.lora_" in inner:
            raise AdapterError(f"{self.path}: {key}: nested target_parameters (several parameters of one module)")
        elif inner.endswith(".lora_A.weight"):
            self._index_factors(key, inner.removesuffix(".lora_A.weight"), keys, embedding=False)
        elif inner.endswith(".lora_embedding_A"):
            self._index_factors(key, inner.removesuffix(".lora_embedding_A"), keys, embedding=True)
        elif inner.endswith(".lora_B.bias"):
            self._index_lora_bias(key, inner.removesuffix(".lora_B.bias"), keys)
        elif inner.endswith(".token_adapter.trainable_tokens_delta"):
            self._index_tokens(key, inner.removesuffix(".token_adapter.trainable_tokens_delta"))
        elif ".lora_" in inner:
            raise AdapterError(f"{self.path}: {key}: not a tensor of a LoRA adapter this library merges")
        else:
            self._index_whole(key, inner.replace(".base_layer.", "."))

    def _index_factors(self, a_key: str, module: str, keys: set[str], embedding: bool) -> None:
        b_key = a_key.replace(".lora_embedding_A", ".lora_embedding_B") if embedding else f"{a_key[:-8]}B.weight"
        if b_key not in keys:
            raise AdapterError(f"{self.path}: {a_key} has no {b_key}")
        name = self._target(f"{module}.weight", a_key)
        rank = self._check_factors(name, a_key, b_key, embedding)
        self._claim(self.factors, name, a_key)
        self.factors[name] = LoraFactors(module, a_key, b_key, self._scaling(module, rank, a_key), embedding)

    def _experts_module(self, inner: str) -> str | None:
        """The fused experts module (θ0's key prefix) whose parameters a ``ParamWrapper``'s A adapts (nested
        wrappers add ``.base_layer``), or None."""
        module = inner.removesuffix(".lora_A.weight")
        while module.endswith(".base_layer"):
            module = module.removesuffix(".base_layer")
        module = self.base.key(module)
        return module if any(f"{module}.{p}" in self.loaded for p in EXPERT_PARAMETERS) else None

    def _index_experts(self, a_key: str, module: str, keys: set[str]) -> None:
        """A ``ParamWrapper``'s factors on a fused expert tensor (experts, out, in), found by their shapes
        (A (r·E × in), B (out × r·E)), indexed as one factor slice per expert matrix."""
        b_key = f"{a_key[:-8]}B.weight"
        if b_key not in keys:
            raise AdapterError(f"{self.path}: {a_key} has no {b_key}")
        a, b = (tuple(self._file.get_slice(k).get_shape()) for k in (a_key, b_key))
        fits = [
            f"{module}.{p}"
            for p in EXPERT_PARAMETERS
            if (info := self.loaded.get(f"{module}.{p}")) is not None
            and len(a) == len(b) == 2
            and a[1] == info.shape[2]
            and b[0] == info.shape[1]
            and a[0] == b[1]
            and a[0] % info.shape[0] == 0
        ]
        if len(fits) != 1:
            shapes = {n: i.shape for n, i in self.loaded.items() if n.startswith(f"{module}.")}
            raise AdapterError(f"{self.path}: LoRA factors A {a} and B {b} fit {len(fits)} of {module}'s {shapes}")
        parameter, experts = fits[0], self.loaded[fits[0]].shape[0]
        rank = a[0] // experts
        scaling = self._scaling(parameter, rank, a_key, rank * experts)
        for piece in self.base.layout.in_loaded(parameter):
            self._claim(self.factors, piece.key, a_key)
            slot = piece.loaded_slot
            cut = ExpertSlice(slot.expert, experts, rank, slot.rows[0] if slot.rows else 0)
            self.factors[piece.key] = LoraFactors(module, a_key, b_key, scaling, expert=cut)
            self.module_tensor.setdefault(piece.key, parameter)

    def _index_lora_bias(self, key: str, module: str, keys: set[str]) -> None:
        name = self.key(f"{module}.bias")
        if name is None:
            raise AdapterError(
                f"{self.path}: {key}: lora_bias on {module}, whose θ0 module has no bias (PEFT cannot merge it)"
            )
        a_key = f"{key[:-6]}A.weight"
        if a_key not in keys:
            raise AdapterError(f"{self.path}: {key} has no {a_key}")
        rank = self._file.get_slice(a_key).get_shape()[0]
        self._check_shape(key, name, self.info[name].shape)
        self._claim(self.bias, name, key)
        self.module_tensor.setdefault(name, f"{module}.bias")
        self.bias[name] = (key, self._scaling(module, rank, a_key))

    def _index_tokens(self, key: str, module: str) -> None:
        name = self._target(f"{module}.weight", key)
        rows = self._token_rows(module, key)
        self._check_shape(key, name, (len(rows), self._shape_of(name)[1]))
        self._claim(self.tokens, name, key)
        self.tokens[name] = (key, rows)

    def _index_whole(self, key: str, module_tensor: str) -> None:
        name = self._target(module_tensor, key)
        self._check_shape(key, name, self._shape_of(name))
        self._claim(self.whole, name, key)
        self.whole[name] = key

    def _target(self, module_tensor: str, key: str) -> str:
        """θ0's name of the tensor a key changes. On a tied θ0 a change to lm_head is a change to the shared
        embedding, unless the adapter unties them: then lm_head is its own tensor, which θ0 may not store."""
        if self.embedding is not None and module_tensor == LM_HEAD:
            name = LM_HEAD if self.unties else self.embedding
        else:
            name = self.key(module_tensor)
        if name is None:
            raise AdapterError(f"{self.path}: {key} adapts {module_tensor}, which θ0 ({self.base.path}) does not have")
        self.module_tensor.setdefault(name, module_tensor)
        return name

    def _claim(self, kind: dict, name: str, key: str) -> None:
        """One change of each kind per tensor, and trainable tokens only alone. Two arise on a tied θ0's
        shared matrix (LoRA on both embed_tokens and lm_head), where PEFT's merge adds both ΔW (twice with
        ensure_weight_tying), which is not what trained."""
        if name in kind or (name in self.tokens if kind is not self.tokens else self.touches(name)):
            tied = " (lm_head is tied to it)" if name == self.embedding else ""
            raise AdapterError(f"{self.path}: {self.keys(name)[0]} and {key} both change θ0's {name}{tied}")

    def _shape_of(self, name: str) -> tuple[int, ...]:
        """θ0's shape of a tensor; an untying adapter's lm_head, which a tied θ0 may not store, is the embedding's."""
        return self.info[self.embedding if name == LM_HEAD and name not in self.info else name].shape

    def _check_shape(self, key: str, name: str, expected: tuple[int, ...]) -> None:
        shape = tuple(self._file.get_slice(key).get_shape())
        if shape != tuple(expected):
            raise AdapterError(
                f"{self.path}: {key} is {shape}, not {tuple(expected)} (θ0's {name} is {self._shape_of(name)})"
            )

    def _check_factors(self, name: str, a_key: str, b_key: str, embedding: bool) -> int:
        """The module's rank, after checking A and B fit θ0's tensor: a linear layer's or a conv's (B is
        out × r × 1…), or an embedding's (A r × vocab, B dim × r)."""
        a, b = (tuple(self._file.get_slice(k).get_shape()) for k in (a_key, b_key))
        shape = self._shape_of(name)
        if embedding:
            fits = len(shape) == 2 and len(a) == 2 and a[1] == shape[0] and b == (shape[1], a[0])
        else:
            fits = len(shape) >= 2 and a[1:] == shape[1:] and b == (shape[0], a[0], *[1] * (len(shape) - 2))
        if not fits:
            targets = self.adapter_config.get("target_parameters")
            hint = " (target_parameters: only 2-D parameters are merged)" if targets else ""
            raise AdapterError(
                f"{self.path}: LoRA factors of {name} are A {a} and B {b}, which do not fit θ0's {shape}{hint}"
            )
        return a[0]

    def _scaling(self, module: str, rank: int, a_key: str, stored_rank: int | None = None) -> float:
        """PEFT's scaling of a module (of a parameter, for ``target_parameters``: PEFT matches its patterns
        against the parameter's path), after checking A's rank is the one the config gives it."""
        config = self.adapter_config
        ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        r_key, alpha_key = pattern_key(ranks, module), pattern_key(alphas, module)
        r = ranks[r_key] if r_key else config.get("r", PEFT_DEFAULT_RANK)
        alpha = alphas[alpha_key] if alpha_key else config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
        if rank != r:
            where = f"rank_pattern[{r_key!r}]" if r_key else "r"
            stored = f" ({stored_rank} rows: one rank per expert)" if stored_rank else ""
            raise AdapterError(
                f"{self.path}: {a_key} has rank {rank}{stored}, but {ADAPTER_CONFIG} gives {module} {where} {r}"
            )
        return alpha / (math.sqrt(r) if config.get("use_rslora") else r)

    def _token_rows(self, module: str, key: str) -> list[int]:
        """The rows a trainable-tokens key replaces: the config's list (the input embedding's), or the entry
        of its dict whose key ends the module's path (PEFT's matching)."""
        indices = self.adapter_config.get("trainable_token_indices")
        if isinstance(indices, dict):
            indices = next((rows for target, rows in indices.items() if module.endswith(target)), None)
        if not indices:
            raise AdapterError(f"{self.path}: {key}: no rows for {module} in trainable_token_indices")
        return list(indices)

    def is_delta(self, name: str) -> bool:
        return name not in self.whole and name not in self.tokens

    def touches(self, name: str) -> bool:
        return any(name in kind for kind in (self.factors, self.bias, self.whole, self.tokens))

    def keys(self, name: str) -> tuple[str, ...]:
        """The adapter's stored tensors that make θ0's tensor ``name``."""
        keys = [self.factors[name].a, self.factors[name].b] if name in self.factors else []
        keys += [self.bias[name][0]] if name in self.bias else []
        keys += [self.whole[name]] if name in self.whole else []
        keys += [self.tokens[name][0]] if name in self.tokens else []
        return tuple(keys)

    def factor_shape(self, name: str) -> tuple[int, ...]:
        """A's shape (rank × in) for θ0's tensor ``name`` (one expert's rows of a ``ParamWrapper``'s A)."""
        shape = tuple(self._file.get_slice(self.factors[name].a).get_shape())
        cut = self.factors[name].expert
        return shape if cut is None else (cut.rank, *shape[1:])

    def factor_dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._file.get_slice(self.factors[name].a).get_dtype()]

    def factor(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """An adapter tensor (rows ``[start, stop)``) in fp32."""
        view = self._file.get_slice(key)
        return (view[start:stop] if start is not None else view[:]).float()

    def reader(self, name: str):
        if name in self.tokens:
            return self._token_reader(name)
        delta = self._delta_reader(name)
        if name not in self.whole:
            return delta
        stored = self._file.get_slice(self.whole[name])
        if name not in self.factors and name not in self.bias:
            return lambda start, stop: stored[start:stop]
        return lambda start, stop: (rows := stored[start:stop].float()) + delta(start, stop).view(rows.shape)

    def _delta_reader(self, name: str):
        """Rows of τ (fp32, one row per row of θ0's tensor)."""
        if name in self.bias:
            key, scaling = self.bias[name]
            return lambda start, stop: self.factor(key, start, stop).mul_(scaling)
        if name not in self.factors:
            per_row = math.prod(self._shape_of(name)[1:])
            return lambda start, stop: torch.zeros(stop - start, per_row)
        factors = self.factors[name]

        def rows(start: int, stop: int) -> torch.Tensor:
            if self._cached is None or self._cached[0] != name:
                self._cached = (name, self._right(factors))
            return (self._left(factors, start, stop) @ self._cached[1]).mul_(factors.scaling)

        return rows

    def _right(self, factors: LoraFactors) -> torch.Tensor:
        """The factor every row block multiplies: A (r × in, a conv's kernel flattened; an expert's r rows of
        it), an embedding's Bᵀ."""
        if factors.embedding:
            return self.factor(factors.b).T
        if (cut := factors.expert) is not None:
            return self.factor(factors.a, cut.expert * cut.rank, (cut.expert + 1) * cut.rank)
        a = self.factor(factors.a)
        return a.reshape(a.shape[0], -1)

    def _left(self, factors: LoraFactors, start: int, stop: int) -> torch.Tensor:
        """The rows of the other factor: B's (out × r; an expert's columns e, e + E, …), an embedding's Aᵀ
        (vocab × r: A's columns)."""
        if factors.embedding:
            return self._file.get_slice(factors.a)[:, start:stop].float().T
        if (cut := factors.expert) is not None:
            return self.factor(factors.b, cut.row + start, cut.row + stop)[:, cut.expert :: cut.experts]
        b = self.factor(factors.b, start, stop)
        return b.reshape(b.shape[0], -1)

    def _token_reader(self, name: str):
        """θ0's rows with the trainable tokens' rows replaced by their stored values (in θ0's dtype, as PEFT
        copies them)."""
        key, indices = self.tokens[name]
        values = self._file.get_tensor(key)
        theta0 = self.base.reader(self.embedding if name == LM_HEAD and name not in self.info else name)

        def rows(start: int, stop: int) -> torch.Tensor:
            out = theta0(start, stop).clone()
            for i, row in enumerate(indices):
                if start <= row < stop:
                    out[row - start] = values[i]
            return out

        return rows

    def config(self) -> dict:
        return self.base.config()

    def aux_files(self) -> list[Path]:
        return self.base.aux_files()
