"""One module per merge method; importing this package registers them all."""

from pipeline.merge.methods import (
    breadcrumbs,
    dare,
    della,
    fisher,
    iso_c,
    iso_cts,
    karcher,
    model_stock,
    multislerp,
    nuslerp,
    sce,
    slerp,
    task_arithmetic,
    ties,
    tsv,
    weighted_average,
)

__all__ = [
    "breadcrumbs",
    "dare",
    "della",
    "fisher",
    "iso_c",
    "iso_cts",
    "karcher",
    "model_stock",
    "multislerp",
    "nuslerp",
    "sce",
    "slerp",
    "task_arithmetic",
    "ties",
    "tsv",
    "weighted_average",
]
