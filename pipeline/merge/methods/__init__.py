"""One module per merge method; importing this package registers them all."""

from pipeline.merge.methods import dare, fisher, iso_c, iso_cts, task_arithmetic, ties, tsv, weighted_average

__all__ = ["dare", "fisher", "iso_c", "iso_cts", "task_arithmetic", "ties", "tsv", "weighted_average"]
