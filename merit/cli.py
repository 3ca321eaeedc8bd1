"""The ``merit`` command. Every command that works on a run takes ``--run-dir`` and ``--set``;
the run directory keeps the resolved ``config.yaml`` so a stage with a command of its own (init,
prepare, calibrate, train, tune-merge, report) can be re-run alone. The run's merges (Fisher
included), evaluation and benchmarks have none: they run inside ``merit run``, which reuses what
exists."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from merit.bench import MEASUREMENTS
from pipeline.threads import set_threads

if TYPE_CHECKING:
    from pipeline.config import RunConfig

# Errors a user fixes (config, data, checkpoint, merge spec, a failed branch): one line and exit
# status 2. Matched among the modules already imported, since a command that raised one has
# imported its module: importing them all up front (torch, torchvision) made `merit --help` 3 s.
USER_ERRORS = {
    "pipeline.config": ("ConfigError",),
    "pipeline.data.example": ("DataError",),
    "pipeline.checkpoint": ("CheckpointError",),
    "pipeline.merge.io": ("MergeInputError",),
    "pipeline.merge.spec": ("MergeSpecError",),
    "calibration.errors": ("CalibrationError", "SplitError"),
    "pipeline.train.launch": ("BranchFailed",),
    "pipeline.eval.benchmarks": ("JobFailed",),
}


def is_user_error(err: BaseException) -> bool:
    return any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, names in USER_ERRORS.items()
        if module in sys.modules
        for name in names
    )


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """CONFIG (or the run directory's saved config) plus overrides; saves the resolved config
    when it is new or changed (a stage's command)."""
    from pipeline.layout import start_run

    return announced(*start_run(args.config, args.overrides, args.run_dir))


def read_run(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The same, written and downloaded nowhere: for the commands that only read a run (``check``,
    ``report``)."""
    from pipeline.hub import cache_only
    from pipeline.layout import run_config

    with cache_only():
        return announced(*run_config(args.config, args.overrides, args.run_dir))


def announced(cfg: RunConfig, run_dir: Path) -> tuple[RunConfig, Path]:
    """Every command says which run directory it uses: by default ``runs/<run.name>`` under the
    current folder, so the same command from another folder is another run."""
    print(f"run directory: {run_dir.resolve()}")
    return cfg, run_dir


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table: numbers right-aligned with thousands separators, text left-aligned."""
    numeric = [all(isinstance(row[i], (int, float)) or row[i] == "" for row in rows) for i in range(len(headers))]
    cells = [[str(h) for h in headers], *[[f"{v:,}" if isinstance(v, int) else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def data_summary(manifest: dict[str, Any]) -> str:
    headers = [
        "source",
        "format",
        "role",
        "examples",
        "train",
        "held-out",
        "train tokens",
        "answer tokens",
        "truncated",
        "skipped",
    ]
    rows, totals = [], [0] * 7
    for name, info in manifest["sources"].items():
        if info.get("dropped"):
            rows.append([name, "dropped", info.get("role", ""), 0, 0, 0, 0, 0, 0, info["skipped"]])
            continue
        counts = [
            info["examples"],
            info["train_examples"],
            len(info["heldout_indices"]),
            info["train_tokens"],
            info["supervised_tokens"],
            info["truncated"],
            info["skipped"],
        ]
        totals = [a + b for a, b in zip(totals, counts)]
        rows.append([name, info["format"], info["role"], *counts])
    rows.append(["total", "", "", *totals])
    return format_table(headers, rows)


def cmd_prepare(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.data.prepare import prepare_data
    from pipeline.models import processor_for

    cfg, run_dir = resolve_run(args)
    manifest = prepare_data(cfg, run_dir, processor_for(cfg, run_dir), force=args.force)
    print(data_summary(manifest))
    return manifest


def cmd_init(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.models import init_model

    cfg, run_dir = resolve_run(args)
    info = init_model(cfg, run_dir, force=args.force)
    params = info["parameters"]
    print(f"θ0: {info['path']}  ({params['total']:,} parameters, {params['trainable']:,} trainable)")
    return info


def cmd_check(args: argparse.Namespace) -> None:
    from pipeline.hub import cache_only
    from pipeline.preflight import check_run

    cfg, run_dir = read_run(args)
    with cache_only():  # the same answer online as offline: what this machine has
        checked = check_run(cfg, run_dir, diloco=args.flow == "diloco")
    for what, found in checked.items():
        print(f"{what:<10} ok: {found}")


def cmd_train(args: argparse.Namespace) -> None:
    from pipeline.train import train_branch
    from pipeline.train.plan import branch_spec

    cfg, run_dir = resolve_run(args)
    result = train_branch(branch_spec(cfg, run_dir, args.branch))
    verb = "resumed and trained" if result.resumed else "trained" if result.seconds else "already complete:"
    print(f"branch {result.name} {verb} {result.steps} steps, {result.tokens_seen:,} tokens: {result.final}")


def cmd_report(args: argparse.Namespace) -> None:
    from pipeline.layout import REPORT
    from pipeline.report import build_report

    _, run_dir = read_run(args)
    report = build_report(run_dir)
    headline = report.get("headline")
    if headline:
        print(f"best merge {headline['model']}: held-out loss {headline['loss']:.4f}")
    print(f"report: {run_dir / REPORT / 'report.md'}")


def cmd_run(args: argparse.Namespace) -> None:
    """The whole pipeline as a Prefect flow: against PREFECT_API_URL's server when set, else an
    ephemeral local one that Prefect starts and stops by itself."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network at run time
    # The ephemeral server's first start migrates its database: over 20 s on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.diloco import diloco
    from flows.merit import joint, merit

    if args.config is None and args.run_dir is None:
        from pipeline.config import ConfigError

        raise ConfigError("merit run needs CONFIG, or --run-dir of a run that has its config.yaml")
    flows = {"merit": merit, "joint": joint, "diloco": diloco}
    _, run_dir = read_run(args)
    try:
        report = flows[args.flow](config=args.config, overrides=args.overrides, run_dir=str(run_dir))
    except RuntimeError as err:  # a failed stage; Prefect has logged the details
        sys.exit(f"merit: the {args.flow} flow failed: {err}")
    print(f"report: {report}")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from calibration.stage import calibrate

    cfg, run_dir = resolve_run(args)
    summary = calibrate(cfg, run_dir, diagnostics=args.diagnostics, force=args.force)
    if "gradient_seconds" in summary:
        print(
            f"calibration: {summary['dim']:,} of {summary['parameters']:,} gradient coordinates ({summary['sketch']}), "
            f"{summary['gradient_seconds']:.1f} s of gradients, {summary['total_seconds']:.1f} s in all"
        )
    shares = ", ".join(f"{100 * v:.1f} %" for v in summary["explained_variance"])
    print(
        f"split into {len(summary['groups'])} groups"
        + (f" (explained variance of the axes: {shares})" if shares else "")
    )
    rows = [
        [k, tokens, ", ".join(group)] for k, (group, tokens) in enumerate(zip(summary["groups"], summary["tokens"]))
    ]
    print(format_table(["group", "tokens", "sources"], rows))
    if "diagnostics" in summary:
        d = summary["diagnostics"]
        curve = ", ".join(f"n={n}: {c:.3f}" for n, c in d["cosine_vs_n"].items())
        print(f"stability: mean adjusted Rand index {d['mean_ari']:.3f} over {len(d['stability_ari'])} resamples")
        print(f"cosine to the n={d['reference_n']} gradient: {curve}")
    print(f"outputs: {run_dir / 'calibration'}")


def cmd_merge(args: argparse.Namespace) -> None:
    from pipeline.merge import MergeSpec, merge_checkpoints
    from pipeline.merge.mergekit_config import is_mergekit, read_config, run_config
    from pipeline.merge.spec import read_yaml

    if is_mergekit(read_yaml(args.spec)):  # a file written for mergekit-yaml
        report = run_config(read_config(args.spec), args.out_path, args.device)
    else:
        spec = MergeSpec.from_yaml(args.spec)
        overrides = {"out_path": args.out_path, "device": args.device}
        spec = spec.model_copy(update={k: v for k, v in overrides.items() if v is not None})
        report = merge_checkpoints(spec)
    counts = ", ".join(f"{m}: {n}" for m, n in report.summary()["method_counts"].items())
    print(f"merged {report.tensors} tensors ({counts}) into {report.out_path}")
    print(
        f"read {report.bytes_read / 1e6:,.1f} MB in {report.total_seconds:.2f} s "
        f"(read {report.read_seconds:.2f} s, compute {report.compute_seconds:.2f} s, "
        f"write {report.write_seconds:.2f} s)"
    )


def cmd_tune_merge(args: argparse.Namespace) -> None:
    from pipeline.layout import SEARCH_PLOT, search_dir
    from pipeline.merge_search import tune_merge

    cfg, run_dir = resolve_run(args)
    result = tune_merge(cfg, run_dir)
    given, best = result["given"], result["best"]
    print(f"{result['merge']}: {len(result['trials'])} trials, dev: {result['metric']}")
    print(f"given weights {[round(w, 3) for w in given['weights']]}: {given['value']:.4f}")
    print(
        f"chosen (trial {best['trial']}) {[round(w, 3) for w in best['weights']]} {best['params'] or ''}: "
        f"{best['value']:.4f}"
    )
    print(f"merged: {best['checkpoint']}; plot: {search_dir(run_dir, result['merge']) / SEARCH_PLOT}")


def cmd_bench(args: argparse.Namespace) -> None:
    """``merit bench NAME [options]``: the benchmark's module parses its own options."""
    import importlib

    module = importlib.import_module(f"merit.bench.{args.what}")
    parser = argparse.ArgumentParser(prog=f"merit bench {args.what}", description=MEASUREMENTS[args.what])
    module.add_arguments(parser)
    module.main(parser.parse_args(args.options))


def add_run_options(p: argparse.ArgumentParser, force: bool = False) -> argparse.ArgumentParser:
    p.add_argument("config", nargs="?", help="YAML run config (default: the run directory's config.yaml)")
    p.add_argument("--run-dir", help="run directory (default: runs/<run.name>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set data.max_length=512",
    )
    if force:
        p.add_argument("--force", action="store_true", help="redo stages whose outputs are up to date")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="load, split and encode the data sources")
    add_run_options(prepare, force=True).set_defaults(func=cmd_prepare)
    init = sub.add_parser("init", help="build or locate θ0, the shared start")
    add_run_options(init, force=True).set_defaults(func=cmd_init)
    check = sub.add_parser("check", help="check what would fail late (θ0, data paths, DeepSpeed, merges, GPUs)")
    add_run_options(check).add_argument(
        "--flow", choices=["merit", "joint", "diloco"], default="merit", help="the flow to check for"
    )
    check.set_defaults(func=cmd_check)
    train = sub.add_parser("train", help="train (or resume) one branch of a run: warmup, joint or a group number")
    add_run_options(train).add_argument("--branch", required=True, help="warmup, joint, 0, 1, ...")
    train.set_defaults(func=cmd_train)
    report = sub.add_parser("report", help="(re)build the run's report from what is on disk")
    add_run_options(report).set_defaults(func=cmd_report)

    run = sub.add_parser(
        "run", help="the whole pipeline as a Prefect flow (local ephemeral server unless PREFECT_API_URL)"
    )
    add_run_options(run).add_argument(
        "--flow",
        choices=["merit", "joint", "diloco"],
        default="merit",
        help="merit (default), the joint baseline alone, or multi-round DiLoCo (diloco.methods)",
    )
    run.set_defaults(func=cmd_run)

    calibrate = sub.add_parser("calibrate", help="per-source gradient conflicts at θ0 and the MERIT split")
    add_run_options(calibrate, force=True).add_argument(
        "--diagnostics", action="store_true", help="also measure split stability and gradient accuracy vs n"
    )
    calibrate.set_defaults(func=cmd_calibrate)

    merge = sub.add_parser("merge", help="merge checkpoints as a mergekit-like YAML spec says")
    merge.add_argument(
        "spec", help="merge spec YAML (base_model, models, method or rules, out_path, ...), or a mergekit config"
    )
    merge.add_argument("--out-path", help="override the spec's out_path")
    merge.add_argument("--device", choices=["cpu", "cuda"], help="override the spec's device")
    merge.set_defaults(func=cmd_merge)

    tune = sub.add_parser(
        "tune-merge", help="search a merge's branch weights (and method parameters) on the dev split (merge.search)"
    )
    add_run_options(tune).set_defaults(func=cmd_tune_merge)

    bench = sub.add_parser(
        "bench",
        help="measurements that print figures: speed, memory, quality (merit bench NAME --help: its options)",
        description="\n".join(f"{name}: {what}" for name, what in MEASUREMENTS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = ", ".join(MEASUREMENTS)
    bench.add_argument("what", choices=list(MEASUREMENTS), metavar="NAME", help=f"the measurement: {names}")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the measurement's own options")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    set_threads()
    try:
        args.func(args)
    except Exception as err:
        if not is_user_error(err):
            raise
        print(f"merit: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
