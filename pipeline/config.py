"""The run configuration: one validated object loaded from YAML, every stage reads its section.

Unknown keys are errors (``extra="forbid"``) so that a typo such as ``data.max_lenght`` fails
loudly instead of silently running with the default.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.checkpoint import write_text_atomic
from pipeline.merge.registry import get_method
from pipeline.merge.rules import Rule, rules_for

SHIPPED_DEEPSPEED = Path(__file__).parent / "train" / "deepspeed"  # train.deepspeed by name
DEEPSPEED_NAMES = ("zero0", "zero2", "zero3")


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the key."""


def require_unique(names: list[str], what: str) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names must be unique, got {names}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = "demo"  # the run's name: its folder (default runs/<name>), its Prefect artifacts, its report
    # seeds every random draw: the tiny model, the built-in corpus, held-out splits, samples, batch order, merges
    seed: int = 0


class FreezeSection(Section):
    """LLaMA-Factory's names and defaults, for full and LoRA fine-tuning alike: the vision tower and
    the projector (the vision tower's ``merger``) frozen, the language model trained, the paper's
    decoder-only setting."""

    freeze_vision_tower: bool = True  # true: the vision tower (its projector apart) gets no gradient
    freeze_multi_modal_projector: bool = True  # true: the projector gets no gradient
    freeze_language_model: bool = False  # true: the language model (blocks, embeddings, lm_head) gets no gradient


class TinyModelSection(Section):
    """Shape of the offline model built when ``model.name_or_path`` is ``tiny`` (Qwen2.5-VL) or
    ``tiny:<model_type>`` (that family: ``pipeline.models.families``)."""

    vocab_size: int = Field(1024, ge=300)  # the vocabulary of the BPE tokenizer learnt on the built-in corpus
    hidden_size: int = Field(64, ge=16)  # the language model's width; hidden_size / num_heads a multiple of 8
    intermediate_size: int = Field(128, ge=16)  # width of the language model's MLPs
    num_layers: int = Field(2, ge=1)  # decoder layers
    num_heads: int = Field(4, ge=1)  # attention heads of the language model
    num_kv_heads: int = Field(2, ge=1)  # key/value heads (grouped-query attention); divides num_heads
    vision_depth: int = Field(2, ge=1)  # blocks of the vision tower
    vision_hidden_size: int = Field(32, ge=8)  # width of the vision tower
    vision_intermediate_size: int = Field(64, ge=8)  # width of the vision tower's MLPs
    vision_heads: int = Field(2, ge=1)  # attention heads of the vision tower
    vision_window: int = Field(56, ge=28)  # pixels; Qwen2.5-VL uses 112
    embedding_rows: int | None = Field(None, ge=300)  # default: the tokenizer's size (Qwen: 151,936)
    # Mixture-of-experts families only (tiny:qwen3_vl_moe, tiny:qwen3_5_moe): experts per layer
    num_experts: int = Field(4, ge=2)
    experts_per_token: int = Field(2, ge=1)  # experts each token is routed to (top-k), at most num_experts
    # Not half of hidden_size: an expert's gate_up (2 × inter, hidden) then differs from its transpose,
    # as in the real models (a layout mistaken for the other cannot pass by shape)
    moe_intermediate_size: int = Field(24, ge=8)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelSection:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim % 8:
            raise ValueError("hidden_size / num_heads must be a multiple of 8 (mrope sections)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must be at most num_experts")
        return self


class ModelSection(Section):
    # "tiny" (Qwen2.5-VL) or "tiny:<model_type>" (offline), a Hugging Face id or a local checkpoint folder
    name_or_path: str = "tiny"
    revision: str | None = None  # of a Hugging Face id: a branch, tag or commit (default: main)
    # The dtype the weights are loaded and trained in; auto: the one the checkpoint's config names
    # (float32 if none). bfloat16 trains in DeepSpeed's bf16 mode (fp32 master weights) where the
    # DeepSpeed config's bf16 is auto, as the shipped ones are.
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # transformers' attention of the model as loaded (padded batches, calibration, evaluation,
    # benchmarks); flash_attention_2 needs the flash-attn package. Packed batches: train.packed_attention.
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    trust_remote_code: bool = False  # run the Python code a checkpoint ships (its config, processor, model)
    # transformers' hub kernels (Liger…): code the Hub sends as a model loads; transformers' default is on
    use_kernels: bool = False
    # Lower bound of an image's area (Qwen families); InternVL tiles as its processor config says
    min_pixels: int = Field(56 * 56, ge=28 * 28)
    # Upper bound of an image's area (Qwen families); a tiny InternVL's most tiles: max_pixels // 56²
    max_pixels: int = Field(112 * 112, ge=28 * 28)
    freeze: FreezeSection = FreezeSection()  # which parts of the model get no gradient
    tiny: TinyModelSection = TinyModelSection()  # the offline model's shape (name_or_path tiny or tiny:<model_type>)

    @field_validator("name_or_path")
    @classmethod
    def _known_tiny_family(cls, name: str) -> str:
        from pipeline.models.families import is_tiny_name, tiny_family  # models import this module

        if is_tiny_name(name):
            tiny_family(name)  # tiny:<model_type> of no family: refused here, naming those there are
        return name


SourceFormat = Literal["builtin", "llava", "sharegpt", "vision_flan", "jsonl", "hf_disk", "hub"]
HUB_FIELDS = ("subsets", "split", "revision", "source_column", "columns")


class SourceSpec(Section):
    """One config entry; ``builtin`` and ``vision_flan`` entries expand to one source per task,
    ``hub`` entries to one per subset of a hub data set (pipeline.data.hub)."""

    # The entry's name, unique across data, warm-up and eval sources; the source's name, but for
    # builtin and vision_flan (a source per task, named by it) and hub (<name>/<subset>)
    name: str
    format: SourceFormat  # how path is read (docs/concepts/data.md); builtin: the built-in corpus, no path
    path: str | None = None  # hub: the data set's id (ORG/NAME) or a folder holding its files
    images_dir: str | None = None  # where image paths resolve, never outside it; default: the data file's folder
    tasks: list[str] | None = None  # builtin / vision_flan: keep only these tasks
    # builtin, without tasks: which of its suites (pipeline.data.builtin.suite_sources): the fine-tuning
    # sources, the skills a warm-up teaches θ0 (both by data.builtin.conflicts), or unseen
    # instruction/task combinations to evaluate
    suite: Literal["finetune", "warmup", "unseen"] = "finetune"
    # per source (hub: per subset, or per source_column value); builtin: how many each task generates
    max_examples: int | None = Field(None, ge=1)
    # the share of the source's examples held out; default: data.heldout_fraction (eval sources: all)
    heldout_fraction: float | None = Field(None, ge=0.0, lt=1.0)
    # hub only: which subsets (the data set card's configs) become sources: all, or their names
    subsets: Literal["all"] | list[str] = "all"
    split: str = "train"  # hub only: the split each subset is read from
    revision: str | None = None  # hub only: the data set's commit (pinned to the cached snapshot's when left out)
    # hub only: a column whose values split one table into sources, one per value (<name>/<value>)
    source_column: str | None = None
    # hub only: the data set's names for a known shape's columns, ours to theirs ({texts: dialogue, ...})
    columns: dict[str, str] | None = None

    @model_validator(mode="after")
    def _path_needed(self) -> SourceSpec:
        if self.format != "builtin" and not self.path:
            raise ValueError(f"source '{self.name}' ({self.format}) needs a path")
        if self.format != "builtin" and self.suite != "finetune":
            raise ValueError(f"source '{self.name}': 'suite' is for builtin sources only")
        # compared with the defaults, not model_fields_set: a saved config writes every field
        changed = [f for f in HUB_FIELDS if getattr(self, f) != type(self).model_fields[f].default]
        if self.format != "hub" and changed:
            raise ValueError(f"source '{self.name}': {changed} are for hub sources only")
        if self.format == "hub" and self.subsets != "all" and not self.subsets:
            raise ValueError(f"source '{self.name}': subsets is 'all' or a non-empty list")
        return self


# The role of a source in an evaluation: fine-tuned on, or an ``eval.sources`` role (the warm-up's
# sources count as retention). Per role, the results give a loss and an accuracy.
EVALUATED_ROLES = ("trained", "unseen", "retention")


class EvalSourceSpec(SourceSpec):
    """A source that is evaluated (all of its examples) and never trained on: ``unseen`` measures
    generalisation to new tasks and instructions, ``retention`` what θ0 could do before fine-tuning."""

    role: Literal["unseen", "retention"] = "unseen"  # unseen: new tasks and instructions; retention: what θ0 could do


class BuiltinSection(Section):
    examples_per_source: int = Field(240, ge=2)  # examples per built-in source (an entry's max_examples overrides)
    image_size: int = Field(112, ge=28)  # side of the corpus's square images, in pixels (the toy benchmarks' too)
    # cued: each source of a conflicting pair has its own instruction, so one model can satisfy
    # both; contradictory: the same question gets different answers in the two sources; opposed:
    # yes/no questions answered truthfully by one source and negated by the other (its own cue).
    conflicts: Literal["cued", "contradictory", "opposed"] = "cued"
    # questions per toy benchmark task (eval.benchmarks naming toy_* tasks): one is 0.5 % of a score
    benchmark_examples: int = Field(200, ge=1)


class DataSection(Section):
    sources: list[SourceSpec] = [SourceSpec(name="builtin", format="builtin")]  # the fine-tuning sources
    # an example's most tokens (its images' included): a longer one is cut from the right, an image
    # the cut would split dropped whole
    max_length: int = Field(1024, ge=16)
    # the share of each source's examples held out for evaluation (seeded; never all of them)
    heldout_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    # a record that cannot be read (bad JSON, no assistant turn, a missing image...): error stops the
    # stage naming it; skip leaves it out, counted by reason in the manifest and the report
    on_bad_record: Literal["error", "skip"] = "error"
    # processes the prepare stage reads and encodes sources in (a hub mixture's subsets side by side);
    # default: the CPUs this process may run on
    prepare_processes: int | None = Field(None, ge=1)
    builtin: BuiltinSection = BuiltinSection()  # the built-in corpus's sources (format builtin)

    @model_validator(mode="after")
    def _unique_names(self) -> DataSection:
        require_unique([s.name for s in self.sources], "source")
        return self


class CalibrationSection(Section):
    """MERIT's split: per-source mean gradients at θ0, their cosine conflicts, PCA, K = 2^r groups."""

    n_per_source: int = Field(200, ge=1)  # training examples sampled (seeded) per source for its mean gradient
    # a source with fewer training examples than n_per_source: its gradient is the mean over all it
    # has (noisier; the stage names it), or the stage refuses to start, naming every such source
    small_sources: Literal["use_all", "refuse"] = "use_all"
    batch_size: int = Field(16, ge=1)  # examples per forward and backward pass
    # Glob patterns over the model's parameter names (in memory); default: the language
    # blocks' weight matrices (a mixture of experts' fused expert tensors and routers included).
    params: list[str] = ["model.language_model.layers.*"]
    # of the parameters matched, weight matrices only (experts' fused tensors too): no norms, biases, conv kernels
    matrices_only: bool = True
    # projection: CountSketch, ~10x more accurate than stride at equal dim (docs: concepts/merit).
    sketch: Literal["stride", "projection"] = "projection"
    dim: int = Field(16384, ge=16)  # coordinates of a sketched gradient (all kept when the parameters have no more)
    centre: bool = False  # subtract the mean gradient before the cosines
    # The principal axes of C: PCA of the column-centred C (the paper's) or eigenvectors of C itself.
    pca: Literal["centred", "uncentred"] = "centred"
    # What the split's halves balance: training examples (the paper's text) or tokens (its project page).
    balance: Literal["samples", "tokens"] = "samples"
    r: int = Field(1, ge=1)  # the split's depth: r principal axes, K = 2^r groups (branches)
    # pca: MERIT's conflict-aware split; random: the Random-K control (random scores, the same
    # balance); given: the groups of calibration.groups
    method: Literal["pca", "random", "given"] = "pca"
    groups: list[list[str]] | None = None  # for method: given
    devices: list[str] | None = None  # default: every GPU, else the CPU
    resamples: int = Field(5, ge=1)  # diagnostics: split stability
    reference_n: int = Field(400, ge=2)  # diagnostics: the gradient the n-sample one is compared with

    @model_validator(mode="after")
    def _groups_for_given(self) -> CalibrationSection:
        if (self.method == "given") != (self.groups is not None):
            raise ValueError("calibration.groups is required for method 'given' and only for it")
        return self


class TrainSection(Section):
    """One branch's training (also the joint baseline and DiLoCo's inner steps)."""

    # The budget: ``epochs`` passes over the branch's training examples, drawn without replacement
    # (MERIT trains each branch on its own group's data once); ``steps`` optimizer steps instead
    # when given (then the joint baseline gets K × steps).
    epochs: float = Field(1.0, gt=0)
    steps: int | None = Field(None, ge=1)  # optimizer steps, in place of epochs when given
    # Micro batches: padding-free packed rows of at most ``max_tokens`` tokens (images' tokens
    # included), filled first-fit from windows of ``packing_window`` shuffled examples, each example
    # with its own positions and attention (docs/concepts/training.md); or, with ``packing: false``,
    # ``micro_batch`` examples padded to the longest.
    packing: bool = True
    max_tokens: int = Field(16384, ge=16)  # per packed micro batch
    packing_window: int = Field(1024, ge=1)  # examples packed first-fit together (micro batches in opening order)
    micro_batch: int = Field(8, ge=1)  # per process, padded batches only (packing: false)
    grad_accum: int = Field(1, ge=1)  # micro batches a rank accumulates per optimizer step
    # The attention of packed micro batches: varlen (each example its own sequence: torch's
    # variable-length flash attention on a GPU, SDPA an example at a time on the CPU), sdpa (a dense
    # block-diagonal mask), flex_attention (a block-sparse mask; transformers 5.25 supports it for
    # Qwen3-VL-MoE and InternVL only), flash_attention_4 (the flash-attn-4 package, where installed).
    # Padded batches use model.attn_implementation.
    packed_attention: Literal["varlen", "sdpa", "flex_attention", "flash_attention_4"] = "varlen"
    # Liger's fused Triton kernels (the liger-kernel package: RMSNorm, SwiGLU, (m)RoPE) patched into
    # the model: auto on a GPU where Liger's patch for the family imports (train.log says), true or
    # refuse to train, false. Never transformers' Hub kernels.
    liger_kernel: bool | Literal["auto"] = "auto"
    fused_optimizer: bool = True  # torch's fused AdamW (one kernel for every tensor), else its default
    # The inner optimizer: AdamW, or Muon (DeepSpeed's, under ZeRO-0/2/3) on the hidden 2-D weight
    # matrices with AdamW (lr, betas) on the rest: embeddings, lm_head, norms, biases, the vision
    # tower's patch embedding. No gradient clipping under Muon (docs/concepts/training.md).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = Field(0.02, gt=0)  # Muon's lr (Keller Jordan's; spectral-norm units per step)
    muon_momentum: float = Field(0.95, ge=0, lt=1)  # Muon's Nesterov momentum
    # AdamW's peak learning rate (under Muon, its AdamW part's): a linear warm-up over warmup_ratio of
    # the steps, then a cosine decay to min_lr_ratio × lr
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's (β1, β2)
    weight_decay: float = Field(0.0, ge=0)  # decoupled weight decay (AdamW's; under Muon, both parts')
    warmup_ratio: float = Field(0.1, ge=0, le=1)  # the share of the steps the lr rises over (at least one step)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decays to lr × this
    clip: float = Field(1.0, gt=0)  # the gradients' global norm is clipped to this; no clipping under Muon
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (long sequences, big models)
    loss_chunk: int = Field(1024, ge=1)  # supervised positions projected on the vocabulary at once
    loader_workers: int = Field(2, ge=0)  # processes encoding the next steps' batches while this one trains
    # A DeepSpeed config: one shipped by name (zero0, zero2, zero3: pipeline/train/deepspeed/<name>.json)
    # or the path of a JSON file of your own; its batch sizes, clipping and precision come from here.
    deepspeed: str = "zero2"
    processes: int = Field(1, ge=1)  # ranks per branch (GPUs, or CPU processes with gloo)
    checkpoint_every: int = Field(50, ge=1)  # optimizer steps between resumable checkpoints (resumed after a kill)
    # seconds a branch's (or DiLoCo worker's) training may run before it is killed and fails; also a
    # worker's longest wait for a round's global weights
    timeout_s: int = Field(6 * 3600, ge=1)
    profile_steps: int = Field(0, ge=0)  # steps recorded by torch.profiler after the first 3 (profile.md); 0: none
    # LoRA through PEFT, with LLaMA-Factory's option names and LoRA defaults, but full fine-tuning by
    # default (LLaMA-Factory's is lora); what else differs: docs/guides/lora.md.
    finetuning_type: Literal["full", "lora"] = "full"
    lora_rank: int = Field(8, ge=1)  # r, the rank of each adapter's B A
    lora_alpha: float | None = Field(None, gt=0)  # default: 2 × lora_rank
    lora_dropout: float = Field(0.0, ge=0, lt=1)  # dropout of an adapter's input (0 with lora_target_parameters)
    # ``all``, as LLaMA-Factory resolves it for Qwen2.5-VL: every linear layer of the parts that train,
    # never ``lm_head`` nor the projector; or module names (a name matches a module whose path ends
    # with it), as a list or comma-separated.
    lora_target: list[str] | Literal["all"] = "all"
    # LoRA on a mixture of experts' fused expert tensors (PEFT's ``target_parameters``, ms-swift's
    # ``--target_parameters``): ``experts`` (every layer's ``mlp.experts.gate_up_proj`` and ``down_proj``)
    # or parameter names (a name matches a parameter whose path ends with it); none by default, as
    # LLaMA-Factory's ``all`` takes linear layers only. One rank-r adapter per expert: docs/guides/lora.md.
    lora_target_parameters: list[str] | Literal["experts"] = []
    additional_target: list[str] = []  # modules trained in full and saved whole (PEFT's modules_to_save)

    @model_validator(mode="before")
    @classmethod
    def _comma_separated(cls, data: Any) -> Any:
        """LLaMA-Factory writes ``lora_target: q_proj,v_proj``: the same as a list."""
        if isinstance(data, dict):
            for key in ("lora_target", "lora_target_parameters", "additional_target"):
                value = data.get(key)
                if isinstance(value, str) and (key == "additional_target" or value not in ("all", "experts")):
                    data = data | {key: [v.strip() for v in value.split(",") if v.strip()]}
        return data

    @model_validator(mode="after")
    def _muon_full(self) -> TrainSection:
        if self.optimizer == "muon" and self.finetuning_type == "lora":
            # Muon orthogonalises the update of a weight matrix; an adapter's thin factors B and A
            # are not the matrices whose update it is meant to shape.
            raise ValueError("train.optimizer muon is for full fine-tuning (finetuning_type full), not LoRA")
        return self

    @model_validator(mode="after")
    def _expert_lora(self) -> TrainSection:
        if self.lora_target_parameters and self.lora_dropout:
            # PEFT's ParamWrapper: the dropout of x cannot be factored out of an expert's B A x
            raise ValueError("train.lora_target_parameters needs train.lora_dropout 0 (PEFT applies none to them)")
        return self

    @property
    def deepspeed_file(self) -> Path:
        """The DeepSpeed config's file: a shipped one by name, or the path given."""
        return (
            SHIPPED_DEEPSPEED / f"{self.deepspeed}.json" if self.deepspeed in DEEPSPEED_NAMES else Path(self.deepspeed)
        )

    @property
    def lora_scaling(self) -> float:
        """alpha / rank: ΔW = scaling · B A."""
        return (self.lora_alpha or 2.0 * self.lora_rank) / self.lora_rank

    def global_batch(self) -> int:
        """Micro batches a step trains on, over all ranks: packed rows, or padded batches' examples."""
        return (1 if self.packing else self.micro_batch) * self.grad_accum * self.processes

    def batch_text(self) -> str:
        """A step's batch over all ranks, in words."""
        n = self.global_batch()
        if self.packing:
            return f"{n} packed micro batch{'es' * (n != 1)} of at most {self.max_tokens:,} tokens"
        return f"{n} example{'s' * (n != 1)}"

    def steps_for(self, items: int) -> int:
        """Optimizer steps of this budget over ``items`` per epoch: packed micro batches, or
        training examples when padded."""
        return self.steps or max(1, math.ceil(self.epochs * items / self.global_batch()))


class WarmupSection(Section):
    """A joint warm-up of θ0 on every source before calibration: MERIT's merge-ready start (the
    paper's joint instruction-tuning stage), whose flat basin keeps the branches mergeable.
    It trains like a branch (the ``train`` section) for ``steps`` optimizer steps."""

    steps: int = Field(0, ge=0)  # 0: θ0 is the model as built or loaded
    lr: float | None = Field(None, gt=0)  # default: train.lr
    # θ0 is a model, not an adapter: a LoRA warm-up is merged into the weights it saves.
    finetuning_type: Literal["full", "lora"] = "full"
    # The data that makes θ0 (the toy's "pre-training"); default: the fine-tuning sources. When
    # given, the branches never train on them and their held-out split measures retention.
    sources: list[SourceSpec] | None = None


class MergeEntry(Section):
    """One merged model of a run, written to ``merged/<name>``: one method for every tensor, or
    per-tensor ``rules`` as in a merge spec. Branches are weighted by their training tokens
    (MERIT's merge) or equally."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # unique in its list; it names the output's folder
    # One merge method for every tensor (routers averaged), e.g. weighted_average, iso_c, ties
    # (docs/concepts/merge-methods.md), with its params; or rules, or merge_method.
    method: str | None = None
    params: dict[str, Any] = {}  # the method's parameters, e.g. {scale: 1.0}
    rules: list[Rule] | None = None  # per tensor: the first rule whose pattern or group matches gives its method
    # Or mergekit's method and parameters, with mergekit's meanings, over the branches: θ0 is the base
    # model and each branch's weight its ``weighting`` share unless the parameters give a weight.
    merge_method: str | None = None
    parameters: dict[str, Any] = {}  # merge_method's parameters, mergekit's names
    weighting: Literal["tokens", "equal"] = "tokens"  # the branches' weights: their training tokens, or equal
    # LoRA branches: the merged ΔW as a model (θ0 + ΔW) or as a PEFT adapter (the merge spec's).
    out_format: Literal["model", "adapter"] = "model"
    # out_format adapter: the rank each merged ΔW is truncated to by SVD (the linear methods need none)
    adapter_rank: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _method_or_rules(self) -> MergeEntry:
        if sum(x is not None for x in (self.method, self.rules, self.merge_method)) != 1:
            raise ValueError(
                f"merge '{self.name}': give one of 'method' (with 'params'), 'rules', or mergekit's 'merge_method' "
                "(with 'parameters')"
            )
        if self.method is not None:
            get_method(self.method).validate(self.params)
        if self.merge_method is not None:
            from pipeline.merge.mergekit_config import check_entry  # it imports the driver, which imports this

            check_entry(self.merge_method, self.parameters)
        return self

    @property
    def effective_rules(self) -> list[Rule]:
        if self.merge_method is not None:
            from pipeline.merge.mergekit_config import METHODS

            return rules_for(METHODS[self.merge_method].ours, {}, None)
        return rules_for(self.method, self.params, self.rules)


class MergeSearch(Section):
    """``merit tune-merge``: the weights of one merge's branches (and ranges of its method's
    parameters) searched by Optuna, each trial scored on the trained sources' held-out examples."""

    enabled: bool = False  # the merit flow searches after its merges; the report shows the chosen merge
    merge: str = "token_average"  # the merge.methods entry searched; its own weights are trial 0
    trials: int = Field(20, ge=1)  # trials in all, the merge's own weights (trial 0) included
    sampler: Literal["tpe", "cmaes"] = "tpe"  # Optuna's sampler: TPE, or CMA-ES
    parallel: int = Field(1, ge=1)  # the merit flow's trials at once, each worker on a GPU of its own if any
    params: dict[str, tuple[float, float]] = {}  # a method parameter -> its range, e.g. density: [0.1, 0.9]
    # Weights per group of consecutive decoder layers (mergekit-evolve's layer granularity): G groups
    # of K weights each; tensors outside the layers take the first group's (final norm, lm_head: the last's).
    layer_groups: int = Field(1, ge=1)
    # the dev split: the last held-out examples of each trained source, never scored by the report
    max_examples_per_source: int = Field(32, ge=1)
    # Or lmms-eval tasks as the dev split (their mean score, maximised), never eval.benchmarks':
    tasks: list[str] = []
    limit: int | None = Field(None, ge=1)  # examples per dev task (lmms-eval --limit)

    @model_validator(mode="after")
    def _ranges(self) -> MergeSearch:
        if bad := {name: r for name, r in self.params.items() if not r[0] < r[1]}:
            raise ValueError(f"merge.search.params: a range is [low, high] with low < high, got {bad}")
        return self


class MergeSection(Section):
    methods: list[MergeEntry] = [MergeEntry(name="token_average", method="weighted_average")]  # the run's merges
    search: MergeSearch = MergeSearch()  # the search of one merge's weights (merit tune-merge)
    device: Literal["cpu", "cuda"] = "cpu"  # where merges (in fp32) and Fisher estimates compute
    out_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # default: the branches' dtype
    fisher_examples: int = Field(64, ge=1)  # per branch, for methods that need a diagonal Fisher
    block_mb: int = Field(1024, ge=1)  # fp32 working memory of TIES, DARE and Fisher per row block

    @model_validator(mode="after")
    def _unique_names(self) -> MergeSection:
        require_unique([m.name for m in self.methods], "merge")
        return self

    @model_validator(mode="after")
    def _searchable(self) -> MergeSection:
        entry = next((m for m in self.methods if m.name == self.search.merge), None)
        if entry is None:
            if self.search.merge == MergeSearch().merge and not (self.search.params or self.search.enabled):
                return self  # the default names a merge this config does not have: nothing to search
            raise ValueError(f"merge.search.merge: no merge named '{self.search.merge}' in merge.methods")
        if entry.merge_method is not None:
            raise ValueError(f"merge.search.merge: '{entry.name}' is a mergekit entry; search a merit method's entry")
        if self.search.params:
            if entry.method is None:
                raise ValueError(f"merge.search.params: merge '{entry.name}' has rules; search one method's params")
            method = get_method(entry.method)
            if unknown := sorted(set(self.search.params) - set(method.params.model_fields)):
                raise ValueError(f"merge.search.params: {entry.method} has no parameters {unknown}")
            low = {name: r[0] for name, r in self.search.params.items()}
            method.validate(entry.params | low)  # the range's ends must be valid values
            method.validate(entry.params | {name: r[1] for name, r in self.search.params.items()})
            given = method.validate(entry.params)
            for name, (low, high) in self.search.params.items():
                value = getattr(given, name)
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(
                        f"merge.search.params.{name}: merge '{entry.name}' gives {name} = {value!r}; a search "
                        f"varies one number from the merge's own: set its params.{name} inside [{low}, {high}]"
                    )
                if not low <= value <= high:  # trial 0 is the merge as configured, never a clamped one
                    raise ValueError(
                        f"merge.search.params.{name}: merge '{entry.name}' has {name} = {value}, outside "
                        f"[{low}, {high}]; widen the range or set its params.{name} inside it"
                    )
        return self


class DilocoMethod(MergeEntry):
    """One DiLoCo variant: the merge method (or rules) that aggregates the workers' pseudo-gradients
    and the outer Nesterov SGD that steps the global weights with the aggregate."""

    outer_lr: float = Field(0.7, gt=0)  # η
    outer_momentum: float = Field(0.9, ge=0, lt=1)  # μ
    nesterov: bool = True  # the outer step's momentum: Nesterov's, or (false) heavy-ball
    # The workers' weights: by the tokens each trained on (MERIT's merge weights), or equal. Default:
    # tokens for sync and quorum rounds, equal for async arrivals (1 / R each, as Liu et al. 2024).
    weighting: Literal["tokens", "equal"] | None = None

    @model_validator(mode="after")
    def _no_fisher(self) -> DilocoMethod:
        if any(get_method(rule.method).needs_fisher for rule in self.effective_rules):
            raise ValueError(f"diloco method '{self.name}': the fisher merge needs Fisher estimates, which rounds lack")
        if self.out_format != "model":
            raise ValueError(
                f"diloco method '{self.name}': rounds step the global weights; out_format is for branch merges"
            )
        return self


class DilocoSection(Section):
    """Multi-round training (DiLoCo, IsoLoCo): R workers train ``inner_steps`` (H) steps from the
    global weights, the aggregate of their pseudo-gradients takes an outer step, ``rounds`` (T)
    times. Each method is a run of its own from θ0 with the same workers, shards and budget."""

    # What each worker trains on: iid, all the sources' examples dealt out R ways; merit, a group of the
    # calibration split; random, a group of a random split of the sources (R a power of 2); given,
    # a group of diloco.groups.
    shards: Literal["iid", "merit", "random", "given"] = "iid"
    workers: int | None = Field(None, ge=1)  # R; default K (calibration.r); merit shards: R = K
    groups: list[list[str]] | None = None  # for shards: given
    inner_steps: int = Field(50, ge=1)  # H
    # T; default: the joint baseline's budget (train.epochs over all the data) in whole rounds.
    rounds: int | None = Field(None, ge=1)
    min_workers: int = Field(1, ge=1)  # a round aggregates at least this many workers, else the run fails
    # sync: a round waits for every worker (or its failure); quorum: it aggregates once `quorum`
    # workers have sent, or `round_timeout_s` after the first payload; the others are stragglers,
    # their late payload dropped, and they join the newest global with their own inner state;
    # async: each payload is applied as it arrives (delayed Nesterov: the momentum once every R
    # arrivals) and its worker goes on from the newest global; each worker sends T payloads.
    sync: Literal["sync", "quorum", "async"] = "sync"
    quorum: int | None = Field(None, ge=1)  # quorum mode: workers a round waits for (default R)
    round_timeout_s: float | None = Field(None, gt=0)  # quorum mode: seconds after a round's first payload
    # async: a worker's local steps scaled to its measured speed against the fastest worker's
    # (H for the fastest), so that the workers send at about the same cadence.
    dynamic_steps: bool = True
    # async: an earlier run's diloco/<variant>/arrivals.json, to apply the same payloads in the
    # same order (trained from the same globals, for the same steps): the same weights.
    replay: str | None = None
    # A worker made k times slower (a CPU share of 1/k: it sleeps (k − 1) × each inner step's time
    # after the step), to rehearse stragglers on equal machines; by worker index.
    slow_workers: dict[int, float] = {}
    # S: a round's tensors split by bytes into S parts, each aggregated on its own (every payload
    # is read S ways: an aggregator reads 1/S of the bytes); the same weights as S = 1, bit for bit.
    aggregators: int = Field(1, ge=1)
    # A deployment of the diloco-part flow (prefect.yaml: diloco-part-local): each part of a round
    # is a flow run of it, on a machine of its pool; without it the S parts run at once as threads
    # of the diloco flow's process.
    aggregator_deployment: str | None = None
    compression: Literal["none", "bf16", "int8", "int4"] = "none"  # of the pseudo-gradients the workers send
    error_feedback: bool = False  # a worker adds what compression dropped to its next round's Δ
    eval_every: int = Field(1, ge=0)  # held-out loss of the global model every n rounds (0: the last only)
    # the variants, each a run of its own: DiLoCo's weighted average and IsoLoCo's Iso-C by default
    methods: list[DilocoMethod] = [
        DilocoMethod(name="diloco", method="weighted_average", outer_lr=0.7, outer_momentum=0.9),
        DilocoMethod(name="isoloco", method="iso_c", outer_lr=1.8, outer_momentum=0.8),
    ]

    @model_validator(mode="after")
    def _consistent(self) -> DilocoSection:
        require_unique([m.name for m in self.methods], "diloco method")
        if (self.shards == "given") != (self.groups is not None):
            raise ValueError("diloco.groups is required for shards 'given' and only for it")
        if self.sync != "quorum" and (self.quorum is not None or self.round_timeout_s is not None):
            raise ValueError("diloco.quorum and diloco.round_timeout_s are for diloco.sync: quorum")
        if self.sync == "async":
            nonlinear = [
                (m.name, rule.method)
                for m in self.methods
                for rule in m.effective_rules
                if not get_method(rule.method).is_linear
            ]
            if nonlinear:
                name, method = nonlinear[0]
                raise ValueError(
                    f"diloco method '{name}': {method} combines several payloads at once; diloco.sync: async "
                    "applies each payload as it arrives, so its aggregate must be linear (weighted_average, "
                    "task_arithmetic): use sync or quorum for it"
                )
            if self.aggregators != 1:
                raise ValueError("diloco.aggregators splits a round of R payloads; diloco.sync: async applies one")
        elif self.replay is not None:
            raise ValueError("diloco.replay replays the arrivals of diloco.sync: async")
        if self.aggregator_deployment is not None and self.aggregators == 1:
            raise ValueError("diloco.aggregator_deployment runs the parts of diloco.aggregators > 1")
        if any(f < 1 for f in self.slow_workers.values()):
            raise ValueError(f"diloco.slow_workers: factors are ≥ 1 (times slower), got {self.slow_workers}")
        if self.groups is not None and self.workers not in (None, len(self.groups)):
            raise ValueError(f"diloco.workers is {self.workers} but diloco.groups has {len(self.groups)} groups")
        return self


class JudgeSection(Section):
    """The judge model of the benchmarks scored by a model (LLaVA-W, MM-Vet, MathVista's answer
    extraction): any OpenAI-compatible server, e.g. a local vLLM."""

    base_url: str  # e.g. http://localhost:8000/v1
    model: str  # the judge's model name on that server, e.g. gpt-4o-2024-08-06
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable that holds its key
    # a judged task with more failed judgements than this gets no score (lmms-eval would score them as numbers)
    max_failures: int = Field(0, ge=0)
    # GPUs of this machine (as this process numbers them) that a local judge server holds: no branch,
    # merge, evaluation or benchmark job is put on them.
    gpus: list[int] = []


class BenchmarkTaskSection(Section):
    """One benchmark task's own settings (``eval.benchmark_tasks.<task>``), over the stage's."""

    limit: int | None = Field(None, ge=1)  # examples (lmms-eval --limit); default eval.benchmark_limit
    max_new_tokens: int | None = Field(None, ge=1)  # default: the task's own, capped by eval.benchmark_max_new_tokens
    seed: int | None = None  # default run.seed
    gen_kwargs: dict[str, int | float | str] = {}  # over eval.benchmark_gen_kwargs and the task's own


class EvalSection(Section):
    """Evaluation of every model of a run: held-out loss and exact-match accuracy of greedy answers
    on the prepared sources, and lmms-eval benchmarks that none of the models trained on."""

    batch_size: int = Field(16, ge=1)  # held-out examples per batch, of the loss and of the greedy answers
    max_examples_per_source: int | None = Field(None, ge=1)  # default: the whole held-out split
    device: str | None = None  # default: the first GPU, else the CPU
    sources: list[EvalSourceSpec] = []  # evaluated, never trained on
    accuracy: bool = True  # exact-match accuracy by batched greedy generation
    max_new_tokens: int = Field(32, ge=1)  # per generated answer
    barrier_points: int = Field(3, ge=0)  # interior points of the loss barrier between branches (0: none)
    branches: bool = True  # evaluate each branch too (at K = 8 with its control: 16 more evaluations)
    # lmms-eval tasks or groups run on every model (θ0, joint, merges, controls' merges, DiLoCo finals):
    # real ones (the paper's: seedbench, mmbench_en_dev, ai2d, textvqa_val, mmmu_val,
    # mathvista_testmini_format, llava_in_the_wild, mmvet) with their data in the Hugging Face cache, the
    # built-in corpus's toy_* tasks (written by prepare; the judged toy_chat is left out without a
    # judge), or tasks of your own under include_path.
    benchmarks: list[str] = []
    include_path: list[str] = []  # folders of extra lmms-eval task YAML files
    judge: JudgeSection | None = None  # required by the judged tasks (llava_in_the_wild, mmvet, mathvista_*, toy_chat)
    benchmark_limit: int | None = Field(None, ge=1)  # examples per task (lmms-eval --limit); default all
    benchmark_batch_size: int = Field(8, ge=1)  # lmms-eval --batch_size (InternVL's lmms-eval model: 1)
    # Generation settings over every task's own (lmms-eval --gen_kwargs), e.g. {max_new_tokens: 64} for a
    # quick look: the scores are then not the benchmarks' as published.
    benchmark_gen_kwargs: dict[str, int | float | str] = {}
    # The most new tokens of one answer, over a task's own (MathVista's YAMLs allow 16,384): a merge that
    # rambles costs minutes, not the job's time limit. null: the tasks' own.
    benchmark_max_new_tokens: int | None = Field(2048, ge=1)
    # Tasks that sample (MM-Vet: temperature 0.2) are answered greedily, so that a job's recorded command
    # gives its score again on any number of processes; false: as the task's YAML says.
    benchmark_greedy: bool = True
    # Settings of one task over the ones above, e.g. {mathvista_testmini_format: {limit: 200, max_new_tokens: 1024}}.
    benchmark_tasks: dict[str, BenchmarkTaskSection] = {}
    benchmark_timeout_s: int = Field(6 * 3600, ge=1)  # one task of one model (a job); a job past it gets no score
    # lmms-eval processes per job, data-parallel (one per GPU). Default: on GPUs, the GPUs shared out
    # among the models to score (at least 1 each); on the CPU, 1.
    benchmark_processes: int | None = Field(None, ge=1)
    # The headline metric of a task, where not the paper's (pipeline/eval/lmms_tasks.py) or, for a task
    # of your own, not the first of its metric_list: e.g. {seedbench: seed_all}.
    benchmark_metrics: dict[str, str] = {}
    benchmark_branches: bool = False  # also run the benchmarks on every branch (with eval.branches)

    @model_validator(mode="after")
    def _unique_benchmarks(self) -> EvalSection:
        require_unique(self.benchmarks, "eval.benchmarks task")
        unknown = sorted(set(self.benchmark_tasks) - set(self.benchmarks))
        if unknown:
            raise ValueError(f"eval.benchmark_tasks names {unknown}, which eval.benchmarks does not run")
        return self


class FlowSection(Section):
    """How the Prefect flow runs the stages."""

    joint_baseline: bool = True  # also train the joint baseline with the branches' total budget
    # Controls: the same K, budget and merges on another split from the same θ0, in controls/<name>/.
    # random: the Random-K split, which tells whether the conflict-aware split is what pays off.
    controls: list[Literal["random"]] = []
    # A deployment of the merit-branch flow (e.g. "merit-branch/branch-gpu"): every branch then trains as
    # a flow run of its own on that deployment's work pool, one machine each; the run directory
    # must be shared. Default: tasks of this flow run, sharing this machine's GPUs.
    branch_deployment: str | None = None
    parallel_branches: int | None = Field(None, ge=1)  # default: GPUs // train.processes, 1 on CPU;
    # with branch_deployment: every branch at once
    branch_retries: int = Field(2, ge=0)  # a retry resumes from the branch's last checkpoint
    retry_delay_s: float = Field(10.0, ge=0)  # seconds before a failed branch, DiLoCo worker or part is retried
    # With branch_deployment (or diloco.aggregator_deployment): each remote flow run beats a
    # heartbeat into the run directory this often...
    heartbeat_s: float = Field(30.0, gt=0)
    # ... and one that is Running but silent this long has lost its machine: it is crashed and
    # resubmitted.
    branch_stale_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _stale_after_several_beats(self) -> FlowSection:
        if self.branch_stale_s < 3 * self.heartbeat_s:
            raise ValueError(
                "flow.branch_stale_s must be at least 3 × flow.heartbeat_s (a late beat is not a lost machine)"
            )
        return self


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    warmup: WarmupSection = WarmupSection()
    calibration: CalibrationSection = CalibrationSection()
    train: TrainSection = TrainSection()
    merge: MergeSection = MergeSection()
    diloco: DilocoSection = DilocoSection()
    eval: EvalSection = EvalSection()
    flow: FlowSection = FlowSection()

    @property
    def branch_count(self) -> int:
        """K: the number of groups the split makes (2^r, or the given groups)."""
        c = self.calibration
        return len(c.groups) if c.method == "given" else 2**c.r

    @property
    def diloco_workers(self) -> int:
        """R: the given shards' count, K for merit shards, else ``diloco.workers`` (default K)."""
        d = self.diloco
        if d.shards == "given":
            return len(d.groups)
        return self.branch_count if d.shards == "merit" else d.workers or self.branch_count

    @property
    def source_entries(self) -> list[SourceSpec]:
        """Every source entry of the run: data.sources, warmup.sources and eval.sources."""
        return self.data.sources + (self.warmup.sources or []) + self.eval.sources

    @model_validator(mode="after")
    def _source_names_unique(self) -> RunConfig:
        names = [s.name for s in self.source_entries]
        require_unique(names, "source (data, warmup and eval sources together)")
        return self

    @model_validator(mode="after")
    def _methods_take_their_inputs(self) -> RunConfig:
        """SLERP takes 2 inputs, Model Stock at least 2: a merge of the K branches, or a DiLoCo round
        of the R workers (a quorum round: of min_workers to R), must give each method its count."""
        counts = [(m.name, rule.method, self.branch_count) for m in self.merge.methods for rule in m.effective_rules]
        d = self.diloco
        rounds = {self.diloco_workers} | ({d.min_workers} if d.sync == "quorum" else set())
        counts += [(m.name, rule.method, r) for m in d.methods for rule in m.effective_rules for r in rounds]
        for name, method, count in counts:
            try:
                get_method(method).check_inputs(count)
            except ValueError as err:
                raise ValueError(f"merge '{name}': {err}") from None
        return self

    @model_validator(mode="after")
    def _search_apart_from_benchmarks(self) -> RunConfig:
        if shared := sorted(set(self.merge.search.tasks) & set(self.eval.benchmarks)):
            raise ValueError(
                f"merge.search.tasks {shared} are also eval.benchmarks: weights searched on the report's "
                "benchmarks would be scored on what chose them; search on other tasks or held-out examples"
            )
        return self

    @model_validator(mode="after")
    def _diloco_workers(self) -> RunConfig:
        d = self.diloco
        if d.shards == "merit" and d.workers not in (None, self.branch_count):
            raise ValueError(
                f"diloco.workers is {d.workers}, but merit shards are the split's K = {self.branch_count} groups"
            )
        if d.min_workers > self.diloco_workers:
            raise ValueError(f"diloco.min_workers ({d.min_workers}) exceeds the {self.diloco_workers} workers")
        if d.quorum is not None and not d.min_workers <= d.quorum <= self.diloco_workers:
            raise ValueError(
                f"diloco.quorum ({d.quorum}) is between diloco.min_workers ({d.min_workers}) "
                f"and the {self.diloco_workers} workers"
            )
        if unknown := sorted(k for k in d.slow_workers if not 0 <= k < self.diloco_workers):
            raise ValueError(f"diloco.slow_workers: no worker {unknown} among the {self.diloco_workers}")
        return self

    @model_validator(mode="after")
    def _diloco_lora(self) -> RunConfig:
        """LoRA workers (``train.finetuning_type: lora``) send a fresh adapter's factors each round
        (pipeline.diloco.lora): what int8 / int4 would drop of them, and an error-feedback residual,
        mean nothing to the next round's new adapter; in async mode a tensor saved whole
        (``train.additional_target``) would need the global its payload started from at the
        aggregator, which may be gone by then."""
        d = self.diloco
        if self.train.finetuning_type != "lora":
            return self
        if d.compression in ("int8", "int4"):
            raise ValueError(
                f"diloco.compression {d.compression} with train.finetuning_type lora: LoRA workers send their "
                "adapter's factors, each round a fresh adapter's; quantise nothing (none) or send bf16"
            )
        if d.error_feedback:
            raise ValueError(
                "diloco.error_feedback with train.finetuning_type lora: a residual of one round's adapter factors "
                "means nothing to the next round's fresh adapter"
            )
        if d.sync == "async" and self.train.additional_target:
            raise ValueError(
                "train.additional_target with train.finetuning_type lora and diloco.sync: async: a module saved "
                "whole is applied against the global its payload started from, which the aggregator may no "
                "longer have; use sync or quorum, or no additional_target"
            )
        return self

    def digest(self, *sections: str) -> str:
        """A stable hash of some sections, used to decide whether a stage's outputs are stale."""
        dump = self.model_dump(mode="json")
        picked = {s: dump[s] for s in sections} if sections else dump
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML (``2e-5``, ``[1, 2]``)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{assignment}' is not of the form key=value")
    *parents, leaf = key.split(".")
    node: Any = tree
    for i, part in enumerate(parents):
        node = _child(node, part, ".".join(parents[: i + 1]))
    value = yaml.safe_load(raw) if raw else ""
    if isinstance(node, list):
        node[_index(node, leaf, key)] = value
    else:
        node[leaf] = value


def _child(node: Any, part: str, path: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise ConfigError(f"config key '{path}' is not a section")
    return node.setdefault(part, {})


def _index(node: list, part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"config key '{path}': '{part}' is not an index of a list of {len(node)}")
    return int(part)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Load and validate a YAML config (or the defaults), then apply ``key=value`` overrides.
    Relative paths in the file are the file's folder's (:func:`resolve_paths`); an override's, the
    current folder's, as any command-line path: the config holds whole paths from then on."""
    tree: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read config {where}: {err}") from err
        if not isinstance(tree, dict):
            raise ConfigError(f"config {where} must be a mapping at the top level")
        resolve_paths(tree, Path(path).resolve().parent)
    for assignment in overrides:
        apply_override(tree, assignment)
    resolve_paths(tree, Path.cwd())  # what is still relative came from an override
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"invalid config {where}:\n{_describe(err)}") from None


def resolve_paths(tree: dict[str, Any], folder: Path) -> None:
    """Make a config file's relative paths absolute against ``folder`` (the file's own), so that a
    command reads the same files from any folder, and the run's saved config names them whole. A
    value that may also be a hub id (``model.name_or_path``, a hub source's ``path``) is a path only
    when it exists there; a DeepSpeed config named ``zero0``/``zero2``/``zero3`` is the shipped one."""

    def resolved(value: Any, maybe_id: bool = False) -> Any:
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            return value
        candidate = folder / value
        return value if maybe_id and not candidate.exists() else str(candidate)

    sections = {k: v for k, v in tree.items() if isinstance(v, dict)}
    model, train, data = sections.get("model", {}), sections.get("train", {}), sections.get("data", {})
    evaluation, diloco = sections.get("eval", {}), sections.get("diloco", {})
    if "name_or_path" in model and not str(model["name_or_path"]).startswith("tiny"):
        model["name_or_path"] = resolved(model["name_or_path"], maybe_id=True)
    if "deepspeed" in train and train["deepspeed"] not in DEEPSPEED_NAMES:
        train["deepspeed"] = resolved(train["deepspeed"])
    for source in [*data.get("sources", []), *evaluation.get("sources", [])]:
        for key in ("path", "images_dir"):
            if isinstance(source, dict) and key in source:
                source[key] = resolved(source[key], maybe_id=key == "path" and source.get("format") == "hub")
    if isinstance(evaluation.get("include_path"), list):
        evaluation["include_path"] = [resolved(p) for p in evaluation["include_path"]]
    if "replay" in diloco:
        diloco["replay"] = resolved(diloco["replay"])


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        scalar = isinstance(e["input"], (str, int, float, bool)) and e["type"] != "extra_forbidden"
        lines.append(f"  {key}: {e['msg']}" + (f" (got {e['input']!r})" if scalar else ""))
    return "\n".join(lines)


def save_config(cfg: RunConfig, path: Path) -> None:
    write_text_atomic(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
