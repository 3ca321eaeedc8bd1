"""DiLoCo mode: R workers train H inner steps from the global weights; the merge library
aggregates their pseudo-gradients; an outer optimizer steps the global weights. In memory
(``aggregate``, for benchmarks and notebooks) or over a run directory (``rounds``, ``worker``)."""

from pipeline.diloco.aggregate import aggregate
from pipeline.diloco.compress import compress, compress_with_feedback, decompress, payload_bytes
from pipeline.diloco.drift import DriftMeter
from pipeline.diloco.outer import DILOCO, ISOLOCO, OuterSGD

__all__ = [
    "DILOCO",
    "ISOLOCO",
    "DriftMeter",
    "OuterSGD",
    "aggregate",
    "compress",
    "compress_with_feedback",
    "decompress",
    "payload_bytes",
]
