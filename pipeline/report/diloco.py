"""The report's DiLoCo section, derived: per variant (``diloco/<method>-<shards>/``, its rounds'
records as ``collect.diloco_runs`` read them) a summary row against the joint baseline and the
best one-shot merge, and notes on the workers left out. (Its plot: ``plots.plot_diloco``.)"""

from __future__ import annotations

from typing import Any


def summary_row(run: dict[str, Any], models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One variant in figures. Overhead: the share of a round's wall time that is not the slowest
    worker's inner steps, over the rounds after the first (which starts the workers: launch);
    async, where a record is one arrival: the share of the workers' time (R × wall) that is not
    inner steps.
    Aggregation: the aggregator's whole time (IO, drift, merge, outer step); the merge: the
    aggregating method's own (e.g. Iso-C's)."""
    records, asynchronous = run["records"], run["sync"] == "async"
    seconds = [r["seconds"] for r in records[1:] or records]
    wall = sum(s["wall"] for s in seconds)
    # Async: the R workers train side by side, so the machine time to compare with is R × wall.
    busy = run["workers"] * wall if asynchronous else wall
    sent = sum(r["bytes"]["sent"] for r in records)
    both_ways = sent + sum(r["bytes"]["received"] for r in records)
    data_parallel = sum(r["bytes"]["data_parallel"] for r in records)  # sent; a ring receives as much
    final = models.get(run["variant"], {}).get("loss")
    merges = [m["loss"] for m in models.values() if m["kind"] == "merged"]
    joint = models.get("joint", {}).get("loss")
    return {
        "variant": run["variant"],
        "method": run["method"],
        "inner": run.get("inner", "AdamW"),
        "outer": run["outer"],
        "R": run["workers"],
        "H": run["inner_steps"],
        "rounds": f"{len(records)}/{run['rounds'] * run['workers']} arrivals"
        if asynchronous
        else f"{len(records)}/{run['rounds']}",
        "sync": run["sync"],
        "payload": payload_kind(run),
        "heldout_loss": final,
        "vs_joint": None if final is None or joint is None else final - joint,
        "vs_best_merge": None if final is None or not merges else final - min(merges),
        "bytes_sent": sent,
        "sent_per_worker_round": round(sent / max(sum(len(r["workers"]) for r in records), 1)),
        "read_per_aggregator_round": round(sum(r["bytes"].get("aggregator_read", 0) for r in records) / len(records)),
        "bytes_vs_data_parallel": both_ways / (2 * data_parallel) if data_parallel else None,
        "overhead_pct": 100 * (1 - sum(s["inner"] for s in seconds) / busy) if wall > 0 else None,
        "aggregation_pct": 100 * sum(s["aggregate"] for s in seconds) / wall if wall > 0 else None,
        "merge_pct": 100 * sum(s["merge"] for s in seconds) / wall if wall > 0 else None,
        "launch_s": max((r["seconds"].get("launch", 0.0) for r in records), default=0.0),
        "left_out": {r["round"]: failed for r in records if (failed := failures(r))},
        "stragglers": {r["round"]: r["stragglers"] for r in records if r.get("stragglers")},
    }


def failures(record: dict[str, Any]) -> list[int]:
    """The workers a round left out because they failed (not the quorum's stragglers)."""
    return [k for k in record["dropped"] if k not in record.get("stragglers", [])]


def payload_kind(run: dict[str, Any]) -> str:
    """What a worker sends: dense pseudo-gradients or, with LoRA workers, an adapter's factors of
    rank r; and how they are compressed (LoRA workers: none or bf16)."""
    compression = run.get("compression", "none")
    kind = f"LoRA r{run['lora_rank']}" if run.get("lora_rank") else "dense"
    return kind if compression == "none" else f"{kind} {compression}"


COLUMNS = {
    "variant": "variant",
    "method": "aggregator",
    "inner": "inner optimizer",
    "outer": "outer step",
    "R": "R",
    "H": "H",
    "rounds": "rounds",
    "sync": "sync",
    "payload": "payload",
    "heldout_loss": "held-out loss",
    "vs_joint": "Δ vs joint",
    "vs_best_merge": "Δ vs best merge",
    "bytes_sent": "bytes sent",
    "sent_per_worker_round": "sent per worker a round",
    "read_per_aggregator_round": "read per aggregator a round",
    "bytes_vs_data_parallel": "sent + received / data-parallel",
    "overhead_pct": "overhead %",
    "aggregation_pct": "aggregation %",
    "merge_pct": "of which the merge %",
    "launch_s": "launch s",
}


def diloco_summary(runs: list[dict[str, Any]], models: list[dict[str, Any]]) -> dict[str, Any]:
    """The section's rows, table and notes (empty when the run has no DiLoCo rounds); ``runs``:
    ``collect.diloco_runs``."""
    if not runs:
        return {}
    by_name = {m["name"]: m for m in models}
    rows = [summary_row(run, by_name) for run in runs]
    notes = [
        f"{row['variant']}, round {r}: workers {workers} left out (failed after their retries)"
        for row in rows
        for r, workers in row["left_out"].items()
    ] + [
        f"{row['variant']}, round {r}: stragglers {workers} left out by the quorum (still training; joined later)"
        for row in rows
        for r, workers in row["stragglers"].items()
    ]
    return {
        "rows": rows,
        "table": {"headers": list(COLUMNS.values()), "rows": [[row[k] for k in COLUMNS] for row in rows]},
        "notes": notes,
    }
