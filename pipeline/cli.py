"""The ``merit`` command. Every command that works on a run takes ``--run-dir`` and ``--set``;
the run directory keeps the resolved ``config.yaml`` so any stage can be re-run alone."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
}


def is_user_error(err: BaseException) -> bool:
    return any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, names in USER_ERRORS.items()
        if module in sys.modules
        for name in names
    )


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """CONFIG (or the run directory's saved config) plus overrides; saves the resolved config."""
    from pipeline.layout import start_run

    return start_run(args.config, args.overrides, args.run_dir)


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
    from pipeline.preflight import check_run

    cfg, run_dir = resolve_run(args)
    for what, found in check_run(cfg, run_dir, diloco=args.flow == "diloco").items():
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

    _, run_dir = resolve_run(args)
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
    try:
        report = flows[args.flow](config=args.config, overrides=args.overrides, run_dir=args.run_dir)
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


def cmd_bench(args: argparse.Namespace) -> None:
    import importlib

    if args.what == "diloco":
        if args.methods is None:
            args.methods = ["diloco"] if args.slow else ["dp", "diloco", "isoloco", "average"]
        if args.slow:  # stragglers: the workers as processes, sync modes compared in wall time
            if args.lora_rank:
                raise SystemExit("merit: error: --lora-rank is for the quality bench (without --slow)")
            importlib.import_module("pipeline.bench.stragglers").main(args)
            return
    importlib.import_module(f"pipeline.bench.{args.what}").main(args)


def add_run_options(p: argparse.ArgumentParser, force: bool = True) -> argparse.ArgumentParser:
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
    add_run_options(prepare).set_defaults(func=cmd_prepare)
    add_run_options(sub.add_parser("init", help="build or locate θ0, the shared start")).set_defaults(func=cmd_init)
    check = sub.add_parser("check", help="check what would fail late (θ0, data paths, DeepSpeed, merges, GPUs)")
    add_run_options(check, force=False).add_argument(
        "--flow", choices=["merit", "joint", "diloco"], default="merit", help="the flow to check for"
    )
    check.set_defaults(func=cmd_check)
    train = sub.add_parser("train", help="train (or resume) one branch of a run: warmup, joint or a group number")
    add_run_options(train, force=False).add_argument("--branch", required=True, help="warmup, joint, 0, 1, ...")
    train.set_defaults(func=cmd_train)
    report = sub.add_parser("report", help="(re)build the run's report from what is on disk")
    add_run_options(report, force=False).set_defaults(func=cmd_report)

    run = sub.add_parser(
        "run", help="the whole pipeline as a Prefect flow (local ephemeral server unless PREFECT_API_URL)"
    )
    add_run_options(run, force=False).add_argument(
        "--flow",
        choices=["merit", "joint", "diloco"],
        default="merit",
        help="merit (default), the joint baseline alone, or multi-round DiLoCo (diloco.methods)",
    )
    run.set_defaults(func=cmd_run)

    calibrate = sub.add_parser("calibrate", help="per-source gradient conflicts at θ0 and the MERIT split")
    add_run_options(calibrate).add_argument(
        "--diagnostics", action="store_true", help="also measure split stability and gradient accuracy vs n"
    )
    calibrate.set_defaults(func=cmd_calibrate)

    merge = sub.add_parser("merge", help="merge checkpoints as a mergekit-like YAML spec says")
    merge.add_argument("spec", help="merge spec YAML (base_model, models, method or rules, out_path, ...)")
    merge.add_argument("--out-path", help="override the spec's out_path")
    merge.add_argument("--device", choices=["cpu", "cuda"], help="override the spec's device")
    merge.set_defaults(func=cmd_merge)

    benches = sub.add_parser("bench", help="benchmarks that print figures").add_subparsers(dest="what", required=True)
    bench = add_run_options(benches.add_parser("data", help="encoding rate vs the tiny model's training rate"))
    bench.add_argument("--examples", type=int, default=1024, help="examples to encode")
    bench.add_argument("--steps", type=int, default=10, help="training steps timed for the reference rate")
    bench.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    bench.add_argument("--like", help="a config whose image sizes, batch and loader workers the step loader takes")
    bench.add_argument("--step-seconds", type=float, help="simulated training step (default: from the FLOPs below)")
    bench.add_argument("--model-params", type=float, default=3.75e9, help="parameters of the simulated model")
    bench.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the simulated step")
    bench.add_argument("--peak-tflops", type=float, default=989.0, help="the simulated device's peak")
    bench = benches.add_parser("merge", help="merge throughput per method beside the streaming floor")
    bench.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of checkpoints")
    bench.add_argument("--size-mb", type=int, default=512, help="size of each generated checkpoint")
    bench.add_argument(
        "--methods", help="comma-separated methods (default: weighted_average,task_arithmetic,ties,dare)"
    )
    bench.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the checkpoints' dtype")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.add_argument("--workdir", help="where to generate the checkpoints (default: the temp folder)")
    bench.add_argument("--repeats", type=int, default=3, help="measurements per figure (the median is printed)")
    bench.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=0,
        help="measure again beside N busy processes (no N: as many as this process has CPUs)",
    )
    bench.add_argument("--mergekit", metavar="CMD", help="also time mergekit's command (e.g. mergekit-yaml)")
    bench = add_run_options(benches.add_parser("train", help="branch trainer vs a plain PyTorch loop; 1 vs 2 ranks"))
    bench.add_argument("--steps", type=int, default=30, help="optimizer steps per measurement")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.add_argument(
        "--size", choices=["tiny", "small", "medium", "3b"], help="model widths (default: 3b on cuda, else tiny)"
    )
    bench.add_argument("--micro-batch", type=int, default=8, help="micro batch of the real-width run")
    bench.add_argument(
        "--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100/H200 bf16 dense: 989)"
    )
    bench = add_run_options(benches.add_parser("memory", help="peak memory of every stage at a width, K = 2, 4, 8"))
    bench.add_argument("--size", choices=["small", "medium", "3b"], default="medium", help="model widths")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the weights' dtype")
    bench.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of merged branches")
    bench.add_argument("--methods", default="weighted_average,ties,dare,iso_c", help="comma-separated merge methods")
    bench.add_argument("--steps", type=int, default=4, help="training steps of the train stage")
    bench = add_run_options(benches.add_parser("load", help="each stage's time unloaded and beside busy processes"))
    bench.add_argument("--size", choices=["small", "medium"], default="small", help="model widths")
    bench.add_argument("--steps", type=int, default=8, help="training steps (the median step is printed)")
    bench.add_argument("--repeats", type=int, default=3, help="measurements per figure (the median is printed)")
    bench.add_argument("--load", type=int, help="busy processes (default: one per CPU this process may use)")
    bench = benches.add_parser("isoc", help="Iso-C: exact SVD vs Newton-Schulz, time and error")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median)")
    bench = benches.add_parser(
        "quality", help="MERIT-K vs Random-K vs joint on the toy benchmarks: seeds, paired statistics, factors"
    )
    bench.add_argument("config", nargs="?", default="configs/benchmark.yaml", help="the base run config")
    bench.add_argument("--workdir", default="runs/bench-quality", help="one run directory per case, under here")
    bench.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="run.seed of each repetition")
    bench.add_argument(
        "--full-seeds",
        type=int,
        default=3,
        help="how many of the seeds also run the larger K, Random-K and the 0.5/2-epoch joint",
    )
    bench.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of branches K (powers of two)")
    bench.add_argument(
        "--joint-epochs", type=float, nargs="*", default=[0.5, 2.0], help="joint baselines besides the 1-epoch one"
    )
    bench.add_argument("--kinds", nargs="+", default=["cued"], choices=["cued", "contradictory"])
    bench.add_argument(
        "--factors",
        nargs="*",
        default=["pca", "balance"],
        choices=["pca", "balance", "lora", "warmup", "lr", "epochs", "width"],
        help="factor tables (from the first kind's full seeds, at the smallest K)",
    )
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    bench = benches.add_parser("diloco", help="DiLoCo, IsoLoCo, averaging vs data-parallel: tiny Qwen2 on the stdlib")
    bench.add_argument("--workers", type=int, nargs="+", default=[4], help="numbers of workers R")
    bench.add_argument("--inner-steps", type=int, default=30, help="inner steps per round (H)")
    bench.add_argument("--rounds", type=int, default=20, help="outer rounds (T)")
    bench.add_argument(
        "--methods",
        nargs="+",
        choices=["dp", "diloco", "isoloco", "average"],
        default=None,
        help="dp (data-parallel baseline), diloco, isoloco, average (outer η 1, μ 0); default: all four, "
        "with --slow: diloco (--slow runs diloco and average)",
    )
    bench.add_argument(
        "--compression",
        nargs="+",
        choices=["none", "bf16", "int8", "int4"],
        default=["none"],
        help="pseudo-gradient compression(s) of the DiLoCo methods, each with error feedback but none",
    )
    bench.add_argument(
        "--lora-rank",
        type=int,
        nargs="+",
        metavar="R",
        help="also each DiLoCo method with LoRA workers of these ranks: a fresh adapter (alpha 2 × rank, every "
        "linear layer but lm_head) each round, its factors sent in fp32",
    )
    bench.add_argument(
        "--out",
        default="runs/bench-diloco",
        help="folder for results.json and loss.png (with --slow: stragglers-<method>.json and .png)",
    )
    bench.add_argument(
        "--slow",
        nargs="+",
        metavar="K:F",
        help="straggler bench: worker K runs F× slower; the R workers run as processes and the sync modes "
        "(sync, quorum with drop or discount, async) are compared in wall time",
    )
    bench.add_argument("--quorum", type=int, help="with --slow: payloads a quorum round waits for (default R − 1)")
    bench.add_argument(
        "--modes",
        nargs="+",
        choices=["sync", "quorum-drop", "quorum-discount", "async"],
        default=["sync", "quorum-drop", "quorum-discount", "async"],
        help="with --slow: the sync modes to run",
    )
    bench = benches.add_parser("aggregators", help="bytes and seconds of a DiLoCo round's busiest aggregator: R × S")
    bench.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="numbers of workers R")
    bench.add_argument("--size", choices=["small", "medium", "3b"], default="small", help="θ0's widths")
    bench.add_argument("--compression", choices=["none", "bf16", "int8", "int4"], default="none")
    bench.add_argument("--method", default="iso_c", help="the merge method that aggregates")
    bench.add_argument("--workdir", help="where to write θ0 and the payloads (default: the temp folder)")
    for bench in benches.choices.values():
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
