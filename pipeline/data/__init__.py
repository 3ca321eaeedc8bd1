"""Multi-source instruction data: loaders, the built-in corpus, encoding, the prepare stage."""

from pipeline.data.encode import IGNORE_INDEX, Collator, Encoded, EncodedDataset, Encoder
from pipeline.data.example import DataError, Example
from pipeline.data.prepare import active_sources, load_split, prepare_data, read_manifest
from pipeline.data.sources import LoadedSources, load_sources

__all__ = [
    "IGNORE_INDEX",
    "Collator",
    "DataError",
    "Encoded",
    "EncodedDataset",
    "Encoder",
    "Example",
    "LoadedSources",
    "active_sources",
    "load_sources",
    "load_split",
    "prepare_data",
    "read_manifest",
]
