"""mergekit's merge YAML, read as written: ``merit merge`` runs a file written for ``mergekit-yaml``
(mergekit 0.1.x) with mergekit's meanings, through this library's methods and streaming driver.

- Keys: ``merge_method``, ``base_model``, ``models: [{model, parameters}]`` or ``slices: [{sources:
  [{model, layer_range, parameters}], parameters}]``, ``parameters``, ``dtype``, ``out_dtype``,
  ``tokenizer_source`` and merit's own ``out_path`` (mergekit-yaml takes the output folder on its
  command line; ``merit merge --out-path`` overrides it).
- A parameter is a value, a gradient (a list of numbers interpolated over a stack of numbered layers,
  ``…layers.N.`` or ``…blocks.N.``: layer i of n sits at i / (n − 1), a tensor outside the layers at
  0), or a list of ``{filter, value}`` whose first entry with no filter or a filter contained in the
  tensor's name gives it. A model's own ``parameters`` come first, then its slice's, then the top
  level's (per-model parameters: ``weight``, ``density``, ``gamma``, ``epsilon``, ``scale``).
- Weights are mergekit's raw weights: summed unnormalised where mergekit sums them (``normalize:
  false``, task arithmetic's and DARE's default), with each method's defaults as mergekit has them
  (TIES and DARE keep every entry unless given ``density``; DARE and DELLA rescale each sparsified τ_k
  to its own L1 norm).
- ``int8_mask`` is accepted and changes nothing: mergekit stores its sign mask in int8 to save memory;
  no such mask is stored here.
- ``dtype``: mergekit computes in it; every merge here computes in float32, and ``dtype`` is the
  output's dtype unless ``out_dtype`` names another.
- ``slices``: ``passthrough`` takes each slice's layers from its one source (a frankenmerge: the
  output's layer count is the slices' total, and its config says so); the other methods take slices
  that cut every model's language-model layers alike and in order (a slice's parameters and gradients
  apply to its layers). Tensors outside those layers come from the first slice, the final norm and
  lm_head from the last, as in mergekit.
- ``tokenizer_source``: ``base`` (the base model's tokenizer), a model (its tokenizer), or ``union``
  (the models' vocabularies joined), accepted where the vocabularies are the same, as those of
  branches of one θ0 are: joining different vocabularies is mergekit's vocabulary surgery, refused
  here. Without it the base model's tokenizer (else the first model's), as mergekit-yaml copies it.

Keys mergekit has and this reader does not are refused by name, with what to write instead.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pipeline.checkpoint import staged_dir, write_manifest
from pipeline.merge.driver import MergeReport, TensorMerge, merge_checkpoints, name_dtype
from pipeline.merge.io import (
    CheckpointReader,
    TensorInfo,
    copy_aux_files,
    copy_tokenizer,
    stream_checkpoint,
    tokenizer_files,
)
from pipeline.merge.layout import Piece
from pipeline.merge.registry import get_method
from pipeline.merge.spec import OUT_DTYPES, MergeSpec, MergeSpecError, read_yaml

Scalar = bool | int | float | str
Gradient = Scalar | list[Scalar]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Conditional(_Strict):
    value: Gradient
    filter: str | None = None


Setting = Conditional | list[Conditional] | Gradient
Parameters = dict[str, Setting]


class InputModel(_Strict):
    model: str
    parameters: Parameters | None = None


class InputSlice(_Strict):
    model: str
    layer_range: tuple[int, int]
    parameters: Parameters | None = None


class OutputSlice(_Strict):
    sources: list[InputSlice]
    parameters: Parameters | None = None


Dtype = Literal["float32", "bfloat16", "float16"]


class MergekitConfig(_Strict):
    merge_method: str
    base_model: str | None = None
    models: list[InputModel] | None = None
    slices: list[OutputSlice] | None = None
    parameters: Parameters | None = None
    dtype: Dtype | None = None
    out_dtype: Dtype | None = None
    tokenizer_source: str | None = None
    out_path: str | None = None  # merit's: where `merit merge` writes

    @model_validator(mode="after")
    def _models_or_slices(self) -> MergekitConfig:
        if (self.models is None) == (self.slices is None):
            raise ValueError("give exactly one of 'models' or 'slices'")
        if self.merge_method not in METHODS:
            raise ValueError(f"merge_method '{self.merge_method}' is not one merit runs; it runs {sorted(METHODS)}")
        return self


# mergekit's keys this reader does not take, with what to write instead.
REFUSED = {
    "modules": "merge per module is not supported: write 'models' (every module merged alike) or 'slices' "
    "over the language model's layers",
    "tokenizer": "write 'tokenizer_source: base | union | <model>' (adding or editing tokens is not supported)",
    "chat_template": "the output keeps its tokenizer's chat template: edit its tokenizer_config.json after the merge",
    "residual_weight": "not supported: merge the residual model as one more input with a weight",
    "base_model (in a slice)": "give base_model once, at the top level",
}


def _refuse_unsupported(data: dict, path: str) -> None:
    for key in ("modules", "tokenizer", "chat_template"):
        if key in data:
            raise MergeSpecError(f"{path}: mergekit key '{key}': {REFUSED[key]}")
    for out_slice in data.get("slices") or []:
        for key, name in (("base_model", "base_model (in a slice)"), ("residual_weight", "residual_weight")):
            if isinstance(out_slice, dict) and key in out_slice:
                raise MergeSpecError(f"{path}: mergekit key '{key}' in a slice: {REFUSED[name]}")
    entries = [*(data.get("models") or []), *(s for o in data.get("slices") or [] for s in o.get("sources", []))]
    for model in [data.get("base_model"), *(e.get("model") for e in entries if isinstance(e, dict))]:
        if isinstance(model, str) and "+" in model:
            raise MergeSpecError(
                f"{path}: model '{model}': mergekit's 'model+lora' is not read here; write a merit merge spec "
                "with 'models: [{adapter: <LoRA folder>}]' over its base_model"
            )


def is_mergekit(data: Any) -> bool:
    """Whether a merge YAML is mergekit's (it names ``merge_method``; merit's names ``method``)."""
    return isinstance(data, dict) and "merge_method" in data


def read_config(path: str | Path) -> MergekitConfig:
    data = read_yaml(path)
    _refuse_unsupported(data, str(path))
    try:
        return MergekitConfig.model_validate(data)
    except ValidationError as err:
        raise MergeSpecError(f"invalid mergekit config {path}:\n{err}") from None


# --- mergekit's methods: their parameters (per model, shared with defaults) and base policy --------------


@dataclass(frozen=True)
class Method:
    ours: str
    per_model: tuple[str, ...] = ()
    shared: tuple[tuple[str, Any], ...] = ()  # (name, default; REQUIRED where mergekit has none)
    base: Literal["task", "pair", "optional", "input"] = "task"  # how mergekit uses base_model
    weighted: bool = True  # ``weight`` is required per model


REQUIRED = object()
_GTA = (("lambda", 1.0), ("int8_mask", False))


def _gta(ours: str, normalize: bool, rescale: bool, *extra: str) -> Method:
    return Method(ours, ("weight", "density", *extra), (*_GTA, ("normalize", normalize), ("rescale", rescale)))


METHODS = {
    "linear": Method("weighted_average", ("weight",), (("normalize", True),), base="input"),
    "task_arithmetic": _gta("task_arithmetic", False, False),
    "ties": _gta("ties", True, False),
    "dare_linear": _gta("dare_linear", False, True),
    "dare_ties": _gta("dare_ties", False, True),
    "breadcrumbs": _gta("breadcrumbs", False, False, "gamma"),
    "breadcrumbs_ties": _gta("breadcrumbs_ties", False, False, "gamma"),
    "della": _gta("della", True, True, "epsilon"),
    "della_linear": _gta("della_linear", False, True, "epsilon"),
    "slerp": Method("slerp", (), (("t", REQUIRED),), base="pair", weighted=False),
    "nuslerp": Method("nuslerp", ("weight",), (("nuslerp_flatten", True), ("nuslerp_row_wise", False)), "optional"),
    "multislerp": Method("multislerp", ("weight",), (("normalize_weights", True), ("eps", 1e-8)), "optional"),
    "karcher": Method("karcher", (), (("max_iter", 10), ("tol", 1e-5)), base="input", weighted=False),
    "model_stock": Method("model_stock", (), (("filter_wise", False),), weighted=False),
    "sce": Method("sce", (), (("select_topk", 1.0), ("int8_mask", False)), weighted=False),
    "passthrough": Method("passthrough", ("scale",), (), base="input", weighted=False),
}
PER_MODEL_DEFAULTS = {"density": 1.0, "gamma": 0.01, "epsilon": 0.15, "scale": None}


def our_merge(name: str, shared: dict[str, Any], per_model: dict[str, list[Any]], k: int, tensor: str) -> TensorMerge:
    """mergekit's ``name`` with these resolved parameters over k inputs, as this library's method, its
    parameters and the weights it is given (raw where mergekit sums unnormalised, divided by their sum
    where it normalises)."""
    method = METHODS[name]
    raw = per_model.get("weight")
    params: dict[str, Any] = {}
    normalize = shared.get("normalize", True)
    if method.ours in {"ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear"}:
        densities = per_model["density"]
        params["density"] = densities[0] if len(set(densities)) == 1 else densities
        params["scale"] = shared["lambda"]
        if method.ours.startswith(("ties", "breadcrumbs")) and shared["rescale"]:
            raise MergeSpecError(f"{name}: 'rescale: true' (an L1 rescale after the trim) is not supported")
        if method.ours.startswith(("dare", "della")):
            params |= {"rescale": shared["rescale"], "rescale_norm": "l1"}
        if method.ours.endswith("ties") or method.ours == "della":
            params["normalize"] = normalize
        for extra in ("gamma", "epsilon"):
            if extra in per_model:
                params[extra] = _one_value(per_model[extra], extra, name, tensor)
        if method.ours.startswith("breadcrumbs"):
            params["density"] = _one_value(densities, "density", name, tensor)
        weights = raw if not normalize else _normalized(raw, tensor)
    elif method.ours == "task_arithmetic":
        total = sum(raw)
        params["scale"] = shared["lambda"] * (1.0 if normalize or abs(total) < 1e-8 else total)
        weights = _normalized(raw, tensor)
    elif method.ours == "weighted_average":
        weights = _normalized(raw, tensor) if normalize else raw
    elif method.ours == "multislerp":
        if not shared["normalize_weights"]:
            raise MergeSpecError("multislerp: 'normalize_weights: false' is not supported")
        params["eps"] = shared["eps"]
        weights = _normalized(raw, tensor)
    else:
        params = {key: value for key, value in shared.items() if key != "int8_mask"}
        weights = _normalized(raw, tensor) if raw is not None else [1.0 / k] * k
    ours = get_method(method.ours)
    try:
        validated = ours.validate(params)
    except ValueError as err:
        raise MergeSpecError(f"tensor {tensor}: {err}") from None
    return TensorMerge(ours, validated, torch.tensor(weights, dtype=torch.float32))


def _normalized(weights: list[float], tensor: str) -> list[float]:
    total = sum(weights)
    if abs(total) < 1e-8:
        raise MergeSpecError(f"tensor {tensor}: the models' weights sum to 0, so they cannot be normalised")
    return [w / total for w in weights]


def _one_value(values: list[Any], key: str, method: str, tensor: str) -> Any:
    if len(set(values)) > 1:
        raise MergeSpecError(
            f"tensor {tensor}: {method} takes one '{key}' for every model here, got {values}: give it in 'parameters'"
        )
    return values[0]


# --- parameters: filters, gradients, precedence -------------------------------------------------------------


def evaluate(setting: Setting, tensor: str, t: float) -> Any:
    """A setting's value for a tensor at position t (mergekit's ``evaluate_setting``); None where no
    filter matches (the next, lower, source of parameters is asked)."""
    if isinstance(setting, Conditional):
        setting = [setting]
    if isinstance(setting, Scalar):
        return setting
    if not setting:
        return None
    if all(isinstance(v, Scalar) for v in setting):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in setting):
            return setting[int(t * (len(setting) - 1))]
        scaled = t * (len(setting) - 1)
        low = int(scaled)
        high = min(len(setting) - 1, low + 1)
        return (1 - (scaled - low)) * setting[low] + (scaled - low) * setting[high]
    for condition in setting:
        if condition.filter in (None, "*") or condition.filter in tensor:
            return evaluate(condition.value, tensor, t)
    return None


def resolve(key: str, sources: Iterable[Parameters | None], t: float, *, tensor: str, default: Any) -> Any:
    for parameters in sources:
        if parameters and key in parameters:
            value = evaluate(parameters[key], tensor, t)
            if value is not None:
                return value
    if default is REQUIRED:
        raise MergeSpecError(f"tensor {tensor}: parameter '{key}' is required and not given")
    return default


# --- layers ----------------------------------------------------------------------------------------------

NUMBERED = re.compile(r"^(?P<stack>(?:.*\.)?(?:layers|blocks))\.(?P<index>\d+)\.")
POST = re.compile(r"^(?:.*\.)?(?:norm|final_layernorm|ln_f)\.[a-z]+$|^lm_head\.")


def layer_of(name: str) -> tuple[str, int] | None:
    """(stack, index) of a tensor in a stack of numbered layers."""
    match = NUMBERED.match(name)
    return (match["stack"], int(match["index"])) if match else None


def stack_sizes(names: Iterable[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name in names:
        found = layer_of(name)
        if found:
            sizes[found[0]] = max(sizes.get(found[0], 0), found[1] + 1)
    return sizes


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def decoder_stack(names: Iterable[str], config: dict, model: str) -> str:
    """The stack of the language model's decoder layers: the one whose size the config names."""
    layers = text_config(config).get("num_hidden_layers")
    stacks = [s for s, n in stack_sizes(names).items() if n == layers and not s.endswith("blocks")]
    if len(stacks) != 1:
        raise MergeSpecError(
            f"{model}: cannot tell its decoder layers ({layers} in its config) by name: slices need them"
        )
    return stacks[0]


def position(index: int, size: int) -> float:
    """mergekit's position of layer ``index`` of ``size`` for a gradient."""
    return index / (size - 1) if size > 1 else 1.0


# --- the merge -------------------------------------------------------------------------------------------


class Plan:
    """A mergekit config over models: the inputs and base of merit's driver and each tensor's merge."""

    def __init__(self, config: MergekitConfig, out_path: str):
        self.config, self.method = config, METHODS[config.merge_method]
        first = config.models[0].model if config.models else config.slices[0].sources[0].model
        self.reader = CheckpointReader(config.base_model or first)
        self.sizes = stack_sizes(self.reader.info)
        self.inputs, self.base = self._inputs()
        if self.method.base == "pair" and len(self.inputs) != 2:
            raise MergeSpecError(f"{config.merge_method}: base_model and exactly one other model, got {self.inputs}")
        self.slices = self._slices()
        self.spec = MergeSpec(
            base_model=self.base,
            models=[{"path": m} for m in self.inputs],
            method=self.method.ours,
            params=self._spec_params(),
            out_path=out_path,
            out_dtype=config.out_dtype or config.dtype,
        )

    def _listed(self) -> list[str]:
        if self.config.models:
            return [m.model for m in self.config.models]
        return [s.model for s in self.config.slices[0].sources]

    def _inputs(self) -> tuple[list[str], str | None]:
        """The models merit's driver merges and its base (θ0), by how mergekit's method uses base_model."""
        listed, base = self._listed(), self.config.base_model
        if self.method.base == "pair":
            if base is None:
                raise MergeSpecError(f"{self.config.merge_method} needs base_model (its t = 0 end)")
            return [base, *(m for m in listed if m != base)], None
        if self.method.base == "input":
            return ([*listed, base] if base and base not in listed else listed), None
        if self.method.base == "task" and base is None:
            raise MergeSpecError(f"{self.config.merge_method} needs base_model")
        return [m for m in listed if m != base], base

    def _slices(self) -> list[OutputSlice] | None:
        """Slices that cut every model's decoder layers alike and in order (a merge other than passthrough)."""
        if self.config.slices is None:
            return None
        stack = decoder_stack(self.reader.info, self.reader.config(), str(self.reader.path))
        start = 0
        for i, out_slice in enumerate(self.config.slices):
            ranges = {tuple(s.layer_range) for s in out_slice.sources}
            models = sorted(s.model for s in out_slice.sources)
            if len(ranges) != 1 or next(iter(ranges))[0] != start or models != sorted(self._listed()):
                raise MergeSpecError(
                    f"slices[{i}]: {self.config.merge_method} merges the same layers of the same models in every "
                    "slice, the slices in order from layer 0; taking different layers from different models is a "
                    "frankenmerge: write it with merge_method: passthrough"
                )
            start = next(iter(ranges))[1]
        if start != self.sizes[stack]:
            raise MergeSpecError(f"slices cover layers 0-{start}, the models have {self.sizes[stack]}")
        self.stack = stack
        return self.config.slices

    def _spec_params(self) -> dict[str, Any]:
        """Parameters merit's spec validates (the first tensor's; each tensor gets its own)."""
        name = next(iter(self.reader.info))
        return self.merge_of(name).params.model_dump(by_alias=False)

    def sources(self, tensor: str, model: str | None) -> tuple[list[Parameters | None], float]:
        """The parameters that apply to ``tensor`` (of ``model``, for a per-model parameter) from the
        highest precedence down, and its position for gradients."""
        found = layer_of(tensor)
        if self.slices is None:
            entry = next((m for m in self.config.models if m.model == model), None)
            t = position(found[1], self.sizes[found[0]]) if found else 0.0
            return [entry and entry.parameters, self.config.parameters], t
        if found and found[0] == self.stack:
            out_slice = next(s for s in self.slices if s.sources[0].layer_range[1] > found[1])
            first, last = out_slice.sources[0].layer_range
            t = position(found[1] - first, last - first)
        else:
            out_slice, t = (self.slices[-1] if POST.match(tensor) else self.slices[0]), 0.0
        source = next((s for s in out_slice.sources if s.model == model), None)
        return [source and source.parameters, out_slice.parameters, self.config.parameters], t

    def merge_of(self, tensor: str) -> TensorMerge:
        shared_sources, t = self.sources(tensor, None)
        shared = {key: resolve(key, shared_sources, t, tensor=tensor, default=d) for key, d in self.method.shared}
        per_model = {}
        for key in self.method.per_model:
            default = REQUIRED if key == "weight" and self.method.weighted else PER_MODEL_DEFAULTS.get(key, 1.0)
            per_model[key] = [
                resolve(key, *self.sources(tensor, model), tensor=tensor, default=default) for model in self.inputs
            ]
        return our_merge(self.config.merge_method, shared, per_model, len(self.inputs), tensor)

    def settings(self, piece: Piece) -> TensorMerge:
        return self.merge_of(piece.name)

    def tokenizer_from(self) -> Path | None:
        """The model whose tokenizer files the output takes (None: the first model's, as merit copies them)."""
        return tokenizer_source(self.config, [Path(m) for m in self._listed()])


def _refuse_unknown_parameters(config: MergekitConfig) -> None:
    """A parameter the method does not take is refused by name (mergekit would ignore a misspelt one)."""
    method = METHODS[config.merge_method]
    known = {*method.per_model, *(name for name, _ in method.shared)}
    places = [("parameters", config.parameters)]
    places += [(f"models[{i}].parameters", m.parameters) for i, m in enumerate(config.models or [])]
    for i, out_slice in enumerate(config.slices or []):
        places.append((f"slices[{i}].parameters", out_slice.parameters))
        places += [(f"slices[{i}].sources[{j}].parameters", s.parameters) for j, s in enumerate(out_slice.sources)]
    for where, parameters in places:
        if unknown := sorted(set(parameters or {}) - known):
            raise MergeSpecError(
                f"{where}: {config.merge_method} takes no parameter {unknown}; it takes {sorted(known)}"
            )


def check_entry(merge_method: str, parameters: dict[str, Any]) -> None:
    """A run's ``merge.methods`` entry in mergekit's terms: a method merit runs, parameters it takes."""
    try:
        config = MergekitConfig(merge_method=merge_method, models=[InputModel(model="branch")], parameters=parameters)
    except ValidationError as err:
        raise ValueError(str(err)) from None
    if merge_method == "passthrough":
        raise ValueError("passthrough copies one model: it is not a merge of the branches")
    try:
        _refuse_unknown_parameters(config)
    except MergeSpecError as err:
        raise ValueError(str(err)) from None


def tokenizer_source(config: MergekitConfig, models: list[Path]) -> Path | None:
    """``tokenizer_source`` as a folder: ``base`` (the default) is the base model's, else the first
    model's, where it has tokenizer files; ``union`` needs every model's vocabulary to be the same."""
    source = config.tokenizer_source
    default = Path(config.base_model) if config.base_model else models[0]
    if source not in (None, "base", "union"):
        return Path(source)
    if source == "union":
        vocabularies = {m: _vocabulary(m) for m in [default, *models]}
        differing = [str(m) for m, v in vocabularies.items() if v != vocabularies[default]]
        if differing:
            raise MergeSpecError(
                f"tokenizer_source union: the tokenizers of {differing} differ from {default}'s; joining different "
                "vocabularies (mergekit's vocabulary surgery) is not supported: merge models of one tokenizer"
            )
    return default if tokenizer_files(default) else None


def _vocabulary(model: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in tokenizer_files(model) if not f.name.startswith("chat_template")}


def run_config(
    config: MergekitConfig,
    out_path: str | None = None,
    device: str | None = None,
    progress: bool = True,
    overrides: dict[str, Any] | None = None,
    **meta: Any,
) -> MergeReport:
    """Run a mergekit config: ``out_path`` overrides the config's, ``overrides`` set merit's spec keys
    (``block_mb``, ``seed``); ``meta`` goes into the output's manifest. Returns merit's merge report."""
    out_path = out_path or config.out_path
    if out_path is None:
        raise MergeSpecError("a mergekit config names no out_path: give --out-path (mergekit-yaml's OUTPUT_PATH)")
    _refuse_unknown_parameters(config)
    if config.merge_method == "passthrough":
        return frankenmerge(config, out_path, progress)
    plan = Plan(config, out_path)
    spec = plan.spec.model_copy(update=(overrides or {}) | ({"device": device} if device else {}))
    return merge_checkpoints(
        spec,
        progress,
        settings=plan.settings,
        tokenizer_from=plan.tokenizer_from(),
        mergekit=config.model_dump(mode="json", exclude_none=True),
        **meta,
    )


def branch_config(
    merge_method: str, parameters: dict[str, Any], base: Path, finals: list[Path], shares: list[float], out: Path
) -> MergekitConfig:
    """A run's mergekit entry over its branches: θ0 the base model, each branch weighted by its share
    unless the parameters give a weight."""
    weighs = "weight" in METHODS[merge_method].per_model and "weight" not in parameters
    models = [InputModel(model=str(f), parameters={"weight": w} if weighs else None) for f, w in zip(finals, shares)]
    return MergekitConfig(
        merge_method=merge_method, base_model=str(base), models=models, parameters=parameters, out_path=str(out)
    )


# --- passthrough: a model, or layers of several stacked (a frankenmerge) ---------------------------------


def frankenmerge(config: MergekitConfig, out_path: str, progress: bool = True) -> MergeReport:
    """Passthrough: each slice's layers copied from its one source (``scale`` multiplying them where
    given), renumbered in order; tensors outside the layers from the first slice's model (the final norm
    and lm_head from the last's). The config says the new layer count (and layer types, where it lists
    them)."""
    start = time.perf_counter()
    if config.slices is None and len(config.models) != 1:
        raise MergeSpecError("passthrough copies one model: give one model, or slices of one source each")
    slices = config.slices or [_whole(config.models[0])]
    if any(len(s.sources) != 1 for s in slices):
        raise MergeSpecError("passthrough copies one model per slice: give each slice exactly one source")
    readers = {s.sources[0].model: CheckpointReader(s.sources[0].model) for s in slices}
    first, last = readers[slices[0].sources[0].model], readers[slices[-1].sources[0].model]
    stack = decoder_stack(first.info, first.config(), str(first.path))
    sources = dict(_passthrough_sources(slices, readers, stack, first, last))
    dtype = OUT_DTYPES.get(config.out_dtype or config.dtype) if (config.out_dtype or config.dtype) else None
    plan = {name: TensorInfo(r.info[src].shape, dtype or r.info[src].dtype) for name, (r, src, _) in sources.items()}

    sizes = {id(reader): stack_sizes(reader.info) for reader in readers.values()}  # once per model, not per tensor

    def produce(name: str) -> torch.Tensor:
        reader, source, parameters = sources[name]
        found = layer_of(source)
        t = position(found[1], sizes[id(reader)][found[0]]) if found else 0.0
        scale = resolve("scale", [parameters, config.parameters], t, tensor=source, default=None)
        tensor = reader.get(source)
        return (tensor.float() * scale if scale is not None else tensor).to(plan[name].dtype)

    layers = sum(len(_layer_indices(s.sources[0], readers[s.sources[0].model], stack)) for s in slices)
    with staged_dir(out_path) as tmp:
        written = stream_checkpoint(tmp, plan, produce, 2 * 1024**3, progress="passthrough" if progress else None)
        copy_aux_files(first.aux_files(), tmp)
        tokenizer = tokenizer_source(config, [Path(m) for m in readers])
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)
        _write_layer_count(
            tmp, first.config(), layers, [(readers[s.sources[0].model], s.sources[0]) for s in slices], stack
        )
        if config.out_dtype or config.dtype:
            name_dtype(tmp, config.out_dtype or config.dtype)
        report = MergeReport(out_path=out_path, tensors=len(plan), bytes_written=written.bytes_written)
        report.total_seconds = time.perf_counter() - start
        write_manifest(
            tmp,
            written.sha256,
            kind="merge",
            mergekit=config.model_dump(mode="json", exclude_none=True),
            report=report.summary(),
            parents=sorted(readers),
        )
    report.methods = dict.fromkeys(plan, "passthrough")
    return report


def _whole(model: InputModel) -> OutputSlice:
    """One model's every layer as a slice."""
    reader = CheckpointReader(model.model)
    size = stack_sizes(reader.info)[decoder_stack(reader.info, reader.config(), model.model)]
    return OutputSlice(sources=[InputSlice(model=model.model, layer_range=(0, size), parameters=model.parameters)])


def _layer_indices(source: InputSlice, reader: CheckpointReader, stack: str) -> range:
    size = stack_sizes(reader.info).get(stack, 0)
    first, last = source.layer_range
    if not 0 <= first < last <= size:
        raise MergeSpecError(f"{source.model}: layer_range {list(source.layer_range)} is not within its {size} layers")
    return range(first, last)


def _passthrough_sources(
    slices: list[OutputSlice], readers: dict[str, CheckpointReader], stack: str, first: CheckpointReader, last
) -> Iterator[tuple[str, tuple[CheckpointReader, str, Parameters | None]]]:
    """(output tensor name, (its reader, its name there, its source's parameters)) in output order."""
    head = slices[0].sources[0]
    for name in first.info:
        if (not layer_of(name) or layer_of(name)[0] != stack) and not POST.match(name):
            yield name, (first, name, head.parameters)
    out = 0
    for out_slice in slices:
        source = out_slice.sources[0]
        reader = readers[source.model]
        for index in _layer_indices(source, reader, stack):
            prefix = f"{stack}.{index}."
            for name in reader.info:
                if name.startswith(prefix):
                    yield f"{stack}.{out}.{name[len(prefix) :]}", (reader, name, source.parameters)
            out += 1
    tail = slices[-1].sources[0]
    for name in last.info:
        if POST.match(name) and not layer_of(name):
            yield name, (last, name, tail.parameters)


def _write_layer_count(folder: Path, config: dict, layers: int, sources: list, stack: str) -> None:
    """config.json with the output's layer count and, where the config lists them, its layer types."""
    path = folder / "config.json"
    text = text_config(config)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        types = []
        for reader, source in sources:
            indices = _layer_indices(source, reader, stack)
            types += [text_config(reader.config())["layer_types"][i] for i in indices]
        text["layer_types"] = types
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
