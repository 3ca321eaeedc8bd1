"""Multi-source instruction data: loaders, the built-in corpus, encoding, the prepare stage.
Exports import their submodule on first use: reading a manifest needs no image processing."""

from pipeline.lazy import lazy_exports

EXPORTS = {
    "IGNORE_INDEX": "encode",
    "Collator": "encode",
    "Encoded": "encode",
    "EncodedDataset": "encode",
    "Encoder": "encode",
    "DataError": "example",
    "Example": "example",
    "active_sources": "manifest",
    "read_manifest": "manifest",
    "load_split": "prepare",
    "prepare_data": "prepare",
    "LoadedSources": "sources",
    "load_sources": "sources",
}
__all__ = sorted(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
