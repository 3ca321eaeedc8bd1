"""What a DiLoCo run trains: per method of ``diloco.methods`` a *variant* ``<method>-<shards>``
(its folder ``diloco/<variant>/``) of R workers, each a branch spec over its shard, and the
number of rounds T.

Shards: ``iid`` (worker k takes every R-th example of the sources' examples in order, from the
k-th on: each source is spread evenly over the workers), ``merit``
(the calibration's conflict-aware groups: R = K), ``random`` (sources in R random groups of
balanced tokens, the split's Random-K control: R = 2^r), ``given`` (``diloco.groups``).
Budget: every worker trains T·H inner steps, its lr schedule spans them; by default T is the
joint baseline's steps (``train.epochs`` over all the data) over R·H, to the nearest whole
round, so DiLoCo, MERIT's branches and the joint model see about the same number of examples
(the report states each one's steps).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from calibration.split import plan_split
from pipeline.checkpoint import write_json_atomic
from pipeline.config import DilocoMethod, RunConfig
from pipeline.data import active_sources, read_manifest
from pipeline.diloco.policy import RoundPolicy, default_weighting
from pipeline.layout import DILOCO_PLAN, diloco_dir, init_path, split_groups
from pipeline.train.plan import joint_spec
from pipeline.train.spec import BranchSpec


class DilocoPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant: str
    folder: str
    method: DilocoMethod
    init: str  # θ0: the weights of round 0
    inner_steps: int  # H
    rounds: int  # T
    compression: str
    error_feedback: bool
    workers: list[BranchSpec]
    sync: str = "sync"
    quorum: int | None = None  # the workers a round waits for (default all)
    round_timeout_s: float | None = None
    slow_workers: dict[int, float] = {}
    aggregators: int = 1  # S parts of a round's tensors, aggregated apart
    dynamic_steps: bool = True  # async: local steps scaled to each worker's speed

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def policy(self) -> RoundPolicy:
        """What decides the rounds: their members, late payloads, weights and async local steps."""
        return RoundPolicy(self.size, self.inner_steps, self.quorum, self.method.weighting, self.dynamic_steps)

    @property
    def final(self) -> int:
        """The last global: T rounds, or in async R·T arrivals (a global each)."""
        return self.rounds * self.size if self.sync == "async" else self.rounds

    def digest(self) -> str:
        """What the run's global weights depend on when every worker sends every round (not
        ``min_workers``, how often it evaluates, sync or quorum mode, the workers' speeds or the
        number of aggregators: a run may resume in another of these modes; async globals are
        arrivals, not rounds, so async is in it)."""
        exclude = {"variant", "folder", "init", "workers", "sync", "quorum", "round_timeout_s", "slow_workers"}
        exclude |= {"aggregators", "dynamic_steps"}  # aggregators: the same weights, bit for bit, whatever S
        inputs = {
            **self.model_dump(mode="json", exclude=exclude),
            "workers": [w.digest() for w in self.workers],
        }
        if self.sync == "async":  # globals are arrivals, not rounds: never resumed in another mode
            inputs["async"] = {"dynamic_steps": self.dynamic_steps}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    def fix(self) -> None:
        """Record the plan in its folder, or refuse a folder that holds another plan's rounds."""
        path = Path(self.folder) / DILOCO_PLAN
        if path.is_file():
            recorded = json.loads(path.read_text()).get("digest")
            if recorded != self.digest():
                raise ValueError(
                    f"DiLoCo {self.variant}: {self.folder} holds rounds of other settings (θ0, shards, H, T, "
                    "method, compression or train settings); move it away (or use another run directory)"
                )
            return
        write_json_atomic(path, {"digest": self.digest(), **self.model_dump(mode="json")})


def variant_name(cfg: RunConfig, method: DilocoMethod) -> str:
    return f"{method.name}-{cfg.diloco.shards}"


def worker_name(variant: str, k: int) -> str:
    return f"{variant}/{k}"


def shards(cfg: RunConfig, run_dir: str | Path) -> list[tuple[list[str], tuple[int, int] | None]]:
    """Each worker's sources and example shard."""
    d, r = cfg.diloco, cfg.diloco_workers
    known = active_sources(read_manifest(run_dir))
    if d.shards == "iid":
        return [(list(known), (k, r)) for k in range(r)]
    if d.shards == "merit":
        groups = split_groups(run_dir)
    elif d.shards == "given":
        groups = d.groups
    else:
        tokens = {name: info["train_tokens"] for name, info in known.items()}
        groups = plan_split(list(known), tokens, r=int(math.log2(r)), method="random", seed=cfg.run.seed).groups
    return [(list(group), None) for group in groups]


def diloco_plan(cfg: RunConfig, run_dir: str | Path, method: DilocoMethod) -> DilocoPlan:
    d, variant = cfg.diloco, variant_name(cfg, method)
    # The weighting's default, settled here so that plan.json and the digest name the one used.
    method = method.model_copy(update={"weighting": method.weighting or default_weighting(d.sync)})
    folder, init = diloco_dir(run_dir, variant), init_path(cfg, run_dir)
    parts = shards(cfg, run_dir)
    rounds = d.rounds or max(1, round(joint_spec(cfg, run_dir).train.steps / (len(parts) * d.inner_steps)))
    train = cfg.train.model_copy(update={"steps": rounds * d.inner_steps})
    config = cfg.model_copy(update={"train": train})
    workers = [
        BranchSpec(
            name=worker_name(variant, k),
            run_dir=str(run_dir),
            init=init,
            sources=sources,
            shard=shard,
            out_dir=str(folder / "workers" / str(k)),
            config=config,
        )
        for k, (sources, shard) in enumerate(parts)
    ]
    return DilocoPlan(
        variant=variant,
        folder=str(folder),
        method=method,
        init=init,
        inner_steps=d.inner_steps,
        rounds=rounds,
        compression=d.compression,
        error_feedback=d.error_feedback,
        workers=workers,
        sync=d.sync,
        quorum=d.quorum if d.sync == "quorum" else None,
        round_timeout_s=d.round_timeout_s,
        slow_workers=d.slow_workers,
        aggregators=d.aggregators,
        dynamic_steps=d.dynamic_steps,
    )


def plan_of(cfg: RunConfig, run_dir: str | Path, variant: str) -> DilocoPlan:
    for method in cfg.diloco.methods:
        if variant_name(cfg, method) == variant:
            return diloco_plan(cfg, run_dir, method)
    known = [variant_name(cfg, m) for m in cfg.diloco.methods]
    raise ValueError(f"unknown DiLoCo variant '{variant}'; the config has {known}")


def check_diloco(cfg: RunConfig, gpus: int) -> str:
    """What would stop a DiLoCo run after its start, checked before it: a ZeRO-3 DeepSpeed config
    (workers set and read whole parameters: stages 0–2), an arrivals file to replay that is not
    there, random shards for R not a power of 2,
    and R workers that do not fit this machine's GPUs (they all train at once)."""
    r, per, problems = cfg.diloco_workers, cfg.train.processes, []
    stage = json.loads(cfg.train.deepspeed_file.read_text()).get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        problems.append(f"{cfg.train.deepspeed_file} uses ZeRO-3; DiLoCo workers support ZeRO stages 0-2")
    if cfg.diloco.replay is not None and not Path(cfg.diloco.replay).is_file():
        problems.append(f"diloco.replay: {cfg.diloco.replay} does not exist")
    if cfg.diloco.shards == "random" and r & (r - 1):
        problems.append(f"random shards split the sources in 2^r groups; {r} workers is not a power of 2")
    if gpus and not cfg.flow.branch_deployment and r * per > gpus:
        problems.append(
            f"the {r} workers train at once: {r} × train.processes = {r * per} GPUs, this machine has {gpus}; "
            "set flow.branch_deployment to give each worker a machine of its own"
        )
    if problems:
        raise ValueError("; ".join(problems))
    t, lora = cfg.train, ""
    if t.finetuning_type == "lora":
        lora = f", each round a fresh LoRA adapter of rank {t.lora_rank} (alpha {t.lora_scaling * t.lora_rank:g})"
    return f"{r} workers × {cfg.diloco.inner_steps} inner steps, {cfg.diloco.shards} shards{lora}"
