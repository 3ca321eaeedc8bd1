"""``merit tune-merge``: a merge's branch weights, and ranges of its method's parameters, searched
by Optuna (TPE or CMA-ES), each trial a streamed merge of the run's branches scored on a dev split.

The dev split is the last ``merge.search.max_examples_per_source`` held-out examples of each
trained source, which the report never scores (with ``merge.search.enabled``, evaluation leaves
them out; a search on held-out loss refuses to run without it), scored by their token-weighted
loss (minimised), or the lmms-eval tasks of
``merge.search.tasks`` (``limit`` examples each), scored by their mean score (maximised): never
the report's benchmarks, which no trial sees (the config and ``merit check`` refuse an overlap, a
group's tasks included). A dev task that gets no score (a judge that fails) fails the trial and
the command, naming it: it never turns into a score. Trial 0 is the merge as the config gives it (MERIT's n_k weights
for ``weighting: tokens``), so the chosen merge is never worse on the dev split than n_k. The
study is an SQLite file in ``search/<merge>/``: a search killed mid-trial resumes where it
stopped (the interrupted trial is marked failed and another run in its place, its merge or staging
folder and its dev jobs' folders removed), its sampler seeded by the trials the study holds so that
it proposes new points, and a finished one is not rerun. A study is tied to its space (the method,
its fixed parameters, the branches, the ranges): a search over another is refused, not mixed in.
A method's integer parameter is searched over integers. With ``merge.search.layer_groups`` G > 1
the weights are G × K genes, one set per group of consecutive decoder layers (mergekit-evolve's
layer granularity; tensors outside the layers take the first group's, the final norm and lm_head
the last's): G times the dimensions, so TPE needs more trials to use them. ``merge.search.parallel`` workers run
trials at once on one study (the merit flow's tasks; each worker its own GPU when there are, its
own sampler seed); one search runs at a time.

Cost per trial: one merge (θ0 and the K branches read once, one checkpoint written), one load of
the merged model, a forward pass over the dev examples. At 7B with K = 8 full branches that is
9 × 15 GB read (≈ 2.5 min at 1 GB/s) and 15 GB written; 20 trials ≈ an hour of one machine,
against the branches' GPU-days.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import is_complete, read_manifest, write_json_atomic
from pipeline.config import MergeEntry, RunConfig
from pipeline.devices import eval_device, usable_gpus
from pipeline.eval.benchmarks import JobFailed, Slot, run_benchmark, search_config
from pipeline.eval.heldout import Heldout, dev_share, score_model, source_roles, summarise
from pipeline.layout import SEARCH_PLOT, SEARCH_RESULT, init_path, search_dir, tuned_dir
from pipeline.merge import CheckpointReader, get_method, merge_checkpoints
from pipeline.merge.driver import TensorMerge
from pipeline.merge.layout import Piece
from pipeline.merge.mergekit_config import POST, decoder_stack, layer_of, stack_sizes
from pipeline.merge.rules import choose
from pipeline.merging import branch_finals, branch_fisher, entry_spec, find_entry, group_tokens, needs_fisher
from pipeline.models import load_model, load_processor
from pipeline.threads import threads_per_process

STUDY = "study.db"
TRIAL = "trial-"  # trial-<number>/: a trial's merge while it is scored


def dev_split(cfg: RunConfig, run_dir: str | Path) -> Heldout:
    """The last ``merge.search.max_examples_per_source`` examples of each trained source's held-out
    split, which the report never scores (evaluation leaves them out while the search is enabled)."""
    if not dev_share(cfg):
        raise ValueError(
            "merge.search on held-out loss needs merge.search.enabled: true, with which the report's held-out "
            "figures leave out the examples the search is scored on; or search on merge.search.tasks"
        )
    return Heldout.load(cfg, run_dir, source_roles(run_dir), part="dev")


def worker_device(cfg: RunConfig, worker: int) -> str:
    """Where worker ``worker`` scores its trials: a GPU of its own when there are, else the CPU."""
    gpus = usable_gpus(cfg)
    return f"cuda:{gpus[worker % len(gpus)]}" if gpus and cfg.eval.device is None else eval_device(cfg)


# transformers builds a model on the meta device under a context that patches torch globally: two
# threads loading at once see each other's meta tensors. Workers load one at a time, score together.
_loading = threading.Lock()


def dev_loss(cfg: RunConfig, checkpoint: Path, dev: Heldout, name: str, device: str) -> float:
    with _loading:
        model = load_model(checkpoint, cfg.model).to(device).eval()
    sources = score_model(cfg, model, load_processor(checkpoint, cfg.model), dev, name, accuracy=False)
    return summarise(sources)["loss"]


def dev_score(cfg: RunConfig, run_dir: Path, checkpoint: Path, name: str, device: str) -> float:
    """The mean score of the dev tasks (lmms-eval jobs in ``eval/benchmarks/<name>/``)."""
    dev, scores = search_config(cfg), []
    gpus = usable_gpus(cfg)  # a trial's job per GPU at once: the CPUs shared out among them
    slot = (
        Slot(1, (int(device.split(":")[1]),), threads_per_process(len(gpus))) if device.startswith("cuda") else Slot()
    )
    for task in cfg.merge.search.tasks:
        record = run_benchmark(dev, run_dir, name, str(checkpoint), task, slot)
        if "score" not in record:
            raise JobFailed(f"{name}: dev task {task} got no score: {record.get('error')}")
        scores.append(record["score"]["score"])
    return sum(scores) / len(scores)


class Search:
    """The study of one merge entry over the run's branches."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, worker: int = 0):
        import optuna

        self.cfg, self.run_dir, self.worker = cfg, Path(run_dir), worker
        self.entry: MergeEntry = find_entry(cfg, cfg.merge.search.merge)
        self.finals = branch_finals(run_dir)
        self.tokens = group_tokens(run_dir, [read_manifest(f)["sources"] for f in self.finals])
        self.fishers = (
            [branch_fisher(cfg, run_dir, k) for k in range(len(self.finals))] if needs_fisher(self.entry) else None
        )
        self.folder = search_dir(run_dir, self.entry.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        search = cfg.merge.search
        self.dev = None if search.tasks else dev_split(cfg, run_dir)
        self.metric = f"mean score of {', '.join(search.tasks)}" if search.tasks else "held-out loss"
        self.storage = storage = optuna.storages.RDBStorage(f"sqlite:///{self.folder / STUDY}")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        direction = "maximize" if search.tasks else "minimize"
        self.study = optuna.create_study(
            study_name=self.entry.name, storage=storage, direction=direction, load_if_exists=True
        )
        if self.study.direction.name.lower() != direction:
            raise ValueError(
                f"{self.folder / STUDY}: this study was {self.study.direction.name.lower()}d; merge.search now "
                f"{direction}s ({self.metric}): move the folder away to start another search"
            )
        self.groups = LayerGroups(init_path(cfg, run_dir), search.layer_groups)
        self._check_space()
        # Seeded by the trials the study holds: a resumed search re-seeded as it began would propose
        # its first points again (TPE's first ten are random draws); workers each their own stream.
        seed = zlib.crc32(repr((cfg.run.seed, worker, len(self.study.trials))).encode())
        samplers = {"cmaes": optuna.samplers.CmaEsSampler, "tpe": optuna.samplers.TPESampler}
        self.study.sampler = samplers[search.sampler](seed=seed)

    def space(self) -> dict[str, Any]:
        """What the study's trials are points of: the merge, its branches and the ranges searched."""
        entry = self.entry
        ranges = {name: list(r) for name, r in self.cfg.merge.search.params.items()}
        space = {"method": entry.method, "params": entry.params, "branches": len(self.finals), "ranges": ranges}
        return space | ({"layer_groups": self.groups.count} if self.groups.count > 1 else {})

    def _check_space(self) -> None:
        """A study's trials are points of one space: a resumed search over another (other ranges, a
        parameter more, other branches) is refused rather than mixed with them."""
        space, before = json.loads(json.dumps(self.space())), self.study.user_attrs.get("space")
        if before is None:
            self.study.set_user_attr("space", space)
        elif before != space:
            changed = sorted(k for k in space.keys() | before.keys() if before.get(k) != space.get(k))
            raise ValueError(
                f"{self.folder / STUDY}: this study searched another space ({', '.join(changed)}: "
                f"{[before.get(k) for k in changed]}, now {[space.get(k) for k in changed]}); "
                "move the folder away to start another search"
            )

    def given(self) -> dict[str, float]:
        """Trial 0: the merge as configured (weights normalised; the method's own parameter values,
        inside their ranges: the config refuses one outside)."""
        raw = self.tokens if self.entry.weighting == "tokens" else [1.0] * len(self.finals)
        point = {gene: raw[k] / max(raw) for gene, k in self.genes()}
        params = get_method(self.entry.method).validate(self.entry.params) if self.entry.method else None
        for name in self.cfg.merge.search.params:
            point[name] = getattr(params, name)
        return point

    def spec(self, point: dict[str, float], out: Path):
        """The merge spec of a point: the entry's method with the point's weights and parameters."""
        entry = self.entry.model_copy(update={"weighting": "equal"})
        if self.cfg.merge.search.params:
            entry = entry.model_copy(update={"params": self.entry.params | self.params(point)})
        base = init_path(self.cfg, self.run_dir)
        spec = entry_spec(self.cfg, entry, base, self.finals, self.tokens, out, self.fishers)
        weights = self.weights(point)
        models = [m.model_copy(update={"weight": w}) for m, w in zip(spec.models, weights)]
        return spec.model_copy(update={"models": models})

    def genes(self) -> list[tuple[str, int]]:
        """(name, branch) of every weight searched: ``w<k>``, or ``w<g>_<k>`` per layer group g."""
        k = len(self.finals)
        if self.groups.count == 1:
            return [(f"w{i}", i) for i in range(k)]
        return [(f"w{g}_{i}", i) for g in range(self.groups.count) for i in range(k)]

    def group_weights(self, point: dict[str, float]) -> list[list[float]]:
        """Each layer group's branch weights, normalised."""
        k, genes = len(self.finals), [point[name] for name, _ in self.genes()]
        return [_normalised(genes[g * k : (g + 1) * k]) for g in range(self.groups.count)]

    def weights(self, point: dict[str, float]) -> list[float]:
        """The branch weights (with layer groups: their mean over the groups)."""
        groups = self.group_weights(point)
        return [sum(column) / len(groups) for column in zip(*groups)]

    def merge(self, point: dict[str, float], out: Path, **meta: Any) -> None:
        spec = self.spec(point, out)
        if self.groups.count == 1:
            merge_checkpoints(spec, progress=False, **meta)
            return
        weights = [torch.tensor(w) for w in self.group_weights(point)]
        rules = spec.effective_rules

        def settings(piece: Piece) -> TensorMerge:
            method, params = choose((piece.name, piece.key), rules)
            return TensorMerge(method, params, weights[self.groups.of(piece.name)])

        merge_checkpoints(spec, progress=False, settings=settings, layer_weights=self.group_weights(point), **meta)

    def params(self, point: dict[str, float]) -> dict[str, float]:
        return {name: point[name] for name in self.cfg.merge.search.params}

    def objective(self, trial) -> float:
        point = {name: trial.suggest_float(name, 0.0, 1.0) for name, _ in self.genes()}
        fields = get_method(self.entry.method).params.model_fields if self.entry.method else {}
        for name, (low, high) in self.cfg.merge.search.params.items():
            if fields[name].annotation is int:  # an iteration count stays a whole number
                point[name] = trial.suggest_int(name, math.ceil(low), math.floor(high))
            else:
                point[name] = trial.suggest_float(name, low, high)
        out, device = self.folder / f"{TRIAL}{trial.number}", worker_device(self.cfg, self.worker)
        jobs = self.run_dir / "eval" / "benchmarks" / f"{self.jobs}{trial.number}"
        self.merge(point, out)
        try:
            if self.dev is None:
                return dev_score(self.cfg, self.run_dir, out, jobs.name, device)
            return dev_loss(self.cfg, out, self.dev, f"trial {trial.number}", device)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(jobs, ignore_errors=True)  # its dev tasks' lmms-eval folders: its value is in the study

    @property
    def jobs(self) -> str:
        """The prefix of a trial's lmms-eval job folders under ``eval/benchmarks/``."""
        return f"search-{self.entry.name}-trial-"

    def dev_size(self) -> str:
        """The dev split in words: how many examples of what."""
        search = self.cfg.merge.search
        if self.dev is None:
            return f"{', '.join(search.tasks)}, " + (
                f"{search.limit} examples each" if search.limit else "all examples"
            )
        return f"{len(self.dev)} held-out examples of {len(self.dev.examples)} trained sources"

    def start(self) -> int:
        """Before any worker: the given weights' trial, then the number of trials left to run. A
        trial still marked running was killed with the search (a frozen trial names its storage row
        only by ``_trial_id``, as optuna's own clean-up does), and so was its checkpoint. The given
        trial runs here, alone: workers that found it waiting would both take it."""
        import optuna

        for trial in self.study.trials:
            if trial.state == optuna.trial.TrialState.RUNNING:
                self.storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
        # What killed trials left: their merges (whole, or a staging folder the merge was writing),
        # and their dev tasks' job folders.
        leftovers = [*self.folder.glob(f"{TRIAL}*"), *self.folder.glob(f".{TRIAL}*")]
        for left in leftovers + list((self.run_dir / "eval" / "benchmarks").glob(f"{self.jobs}*")):
            shutil.rmtree(left)
        done = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        waiting = [t for t in self.study.trials if t.state == optuna.trial.TrialState.WAITING]
        if not any(t.user_attrs.get("given") for t in done + waiting):
            self.study.enqueue_trial(self.given(), user_attrs={"given": True})
        if not any(t.user_attrs.get("given") for t in done):
            self.optimize(1)
            done += [self.study.trials[-1]]
        return max(0, self.cfg.merge.search.trials - len(done))

    def optimize(self, trials: int) -> None:
        self.study.optimize(self.objective, n_trials=trials, show_progress_bar=self.worker == 0)

    def run(self) -> dict[str, Any]:
        """The whole search in this process, one trial after the other."""
        self.optimize(self.start())
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """The chosen merge written to ``best/``, ``search.json`` and the plot."""
        import optuna

        trials = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        given, best = next(t for t in trials if t.user_attrs.get("given")), self.study.best_trial
        best_dir = tuned_dir(self.run_dir, self.entry.name)
        spec = self.spec(best.params, best_dir)
        layers = self.group_weights(best.params) if self.groups.count > 1 else None
        manifest = read_manifest(best_dir) if is_complete(best_dir) else {}
        kept = manifest.get("spec") == spec.model_dump(mode="json") and manifest.get("layer_weights") == layers
        if not kept:  # else a finished search run again: its chosen merge is already there
            self.merge(best.params, best_dir, trial=best.number)
        result = {
            "merge": self.entry.name,
            "method": self.entry.method,
            "sampler": self.cfg.merge.search.sampler,
            "metric": self.metric,
            "lower_is_better": self.dev is not None,
            "dev": self.dev_size(),
            "given": {"trial": given.number, "value": given.value, "weights": self.weights(given.params)},
            "best": {
                "trial": best.number,
                "value": best.value,
                "weights": self.weights(best.params),
                **({"layer_weights": layers} if layers else {}),
                "params": self.params(best.params),
                "checkpoint": str(best_dir),
            },
            "trials": [
                {
                    "trial": t.number,
                    "value": t.value,
                    "weights": self.weights(t.params),
                    "params": self.params(t.params),
                }
                for t in trials
            ],
        }
        write_json_atomic(self.folder / SEARCH_RESULT, result)
        plot_search(result, self.folder / SEARCH_PLOT)
        return result


def _normalised(raw: list[float]) -> list[float]:
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else [1 / len(raw)] * len(raw)


class LayerGroups:
    """G groups of consecutive decoder layers of θ0 (sizes differing by at most one): the group of a
    tensor by its layer; outside the layers the first group, the final norm and lm_head the last."""

    def __init__(self, theta0: Path, count: int):
        self.count = count
        if count == 1:
            return
        reader = CheckpointReader(theta0)
        self.stack = decoder_stack(reader.info, reader.config(), str(theta0))
        self.layers = stack_sizes(reader.info)[self.stack]
        if count > self.layers:
            raise ValueError(f"merge.search.layer_groups: {count} groups of {self.layers} decoder layers")

    def of(self, name: str) -> int:
        found = layer_of(name)
        if found and found[0] == self.stack:
            return found[1] * self.count // self.layers
        return self.count - 1 if POST.match(name) else 0


def tune_merge(cfg: RunConfig, run_dir: str | Path) -> dict[str, Any]:
    return Search(cfg, run_dir).run()


def plot_search(result: dict[str, Any], path: Path) -> None:
    """Dev loss per trial with the running best, beside the given and the chosen weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = result["trials"]
    numbers, values = [t["trial"] for t in trials], [t["value"] for t in trials]
    best = min if result["lower_is_better"] else max
    running = [best(values[: i + 1]) for i in range(len(values))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(numbers, values, "o", color="tab:blue", label="trial")
    left.plot(numbers, running, "-", color="tab:green", label="best so far")
    left.axhline(result["given"]["value"], color="tab:red", linestyle="--", label="given weights")
    left.set(xlabel="trial", ylabel=f"dev: {result['metric']}", title=f"search of {result['merge']}")
    left.legend()
    k = range(len(result["best"]["weights"]))
    right.bar([i - 0.2 for i in k], result["given"]["weights"], width=0.4, color="tab:red", label="given")
    right.bar([i + 0.2 for i in k], result["best"]["weights"], width=0.4, color="tab:green", label="chosen")
    right.set(xlabel="branch", ylabel="weight", title="branch weights", xticks=list(k))
    right.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
