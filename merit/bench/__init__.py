"""The ``merit bench`` commands: each module measures one thing, declares its own options
(``add_arguments``) and runs (``main``). Above the library and the flows (a measurement may run a
flow); nothing under ``pipeline/`` imports them. Dated results: ``docs/results/``."""

MEASUREMENTS = {  # name: what it measures (``merit bench --help``); the module merit.bench.<name>
    "data": "encoding rate vs the tiny model's training rate",
    "merge": "merge throughput per method beside the streaming floor",
    "train": "branch trainer: tokens/s, padding, MFU, memory, a profile; packed vs padded; 1 vs 2 ranks",
    "memory": "peak memory of every stage at a width, K = 2, 4, 8",
    "load": "each stage's time unloaded and beside busy processes",
    "isoc": "Iso-C: exact SVD vs Newton-Schulz, time and error",
    "quality": "MERIT-K vs Random-K vs joint on the toy benchmarks: seeds, paired statistics, factors",
    "diloco": "DiLoCo, IsoLoCo, averaging vs data-parallel: tiny Qwen2 on the stdlib",
    "aggregators": "bytes and seconds of a DiLoCo round's busiest aggregator: R × S",
    "experts": "a mixture-of-experts run: experts each branch trained, their overlap and agreement",
    "sources": "prepare and calibration on a hub mixture of 18 to 176 subsets: time, memory, split",
    "mixture": "prepare, calibrate and a training rank on mixtures of 10 k to 1 M examples: rate, memory",
}
