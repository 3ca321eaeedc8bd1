"""Offline, lmms-eval's hub data sets are read from the hub cache.

lmms-eval loads every task's data with ``datasets.load_dataset("ORG/NAME", name=...)``. Users fetch
those data sets with ``hf download ORG/NAME --repo-type dataset`` into the hub cache and run offline
(``HF_HUB_OFFLINE=1``), but offline ``datasets`` only finds a data set it has built in its own cache
(``HF_DATASETS_CACHE``): a hub id it never built fails with "Couldn't reach 'ORG/NAME' on the Hub
(OfflineModeIsEnabled)", files in the hub cache or not. The snapshot folder itself loads (its README
names the configs and their files), so offline a hub id that the datasets cache lacks is read from
its snapshot instead. Online, or when the datasets cache has it, nothing changes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import datasets

from pipeline.config import ConfigError
from pipeline.hub import REPO_ID, dataset_built, dataset_snapshot, datasets_cache, offline


class DatasetNotFoundError(ConfigError):
    """A hub data set that neither the datasets cache nor the hub cache holds, while offline."""


def read_hub_datasets_from_cache() -> None:
    """Wrap ``datasets.load_dataset`` (once, and only offline) so hub ids load from their snapshots."""
    if not offline() or getattr(datasets.load_dataset, "reads_hub_cache", False):
        return
    load_dataset = datasets.load_dataset

    @functools.wraps(load_dataset)
    def from_hub_cache(path, *args, **kwargs):
        # Folders, packaged builders (json, parquet, imagefolder...: no slash) and data sets datasets
        # built before (its own offline fallback reads the build) load as they always did.
        name = args[0] if args else kwargs.get("name")
        local = not REPO_ID.fullmatch(str(path)) or Path(path).expanduser().exists()
        if local or dataset_built(path, name, kwargs.get("cache_dir")):
            return load_dataset(path, *args, **kwargs)
        folder = dataset_snapshot(path, kwargs.pop("revision", None))  # the revision picks the snapshot
        if folder is None:
            raise DatasetNotFoundError(
                f"data set {path}: HF_HUB_OFFLINE is set and it is neither in the datasets cache "
                f"{kwargs.get('cache_dir') or datasets_cache()} nor in the Hugging Face hub cache. Download it "
                f"first: `hf download {path} --repo-type dataset` (with HF_HOME pointing at the cache the run reads)"
            )
        return load_dataset(str(folder), *args, **kwargs)

    from_hub_cache.reads_hub_cache = True
    datasets.load_dataset = from_hub_cache
