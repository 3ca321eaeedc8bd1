"""The prepared example store: rows written in shards, read back by index, memory-mapped."""

import pickle

import numpy as np
import pytest
import torch
from conftest import small_config

import pipeline.data.store as store_module
from pipeline.data import Encoder
from pipeline.data.builtin import generate
from pipeline.data.store import SourceStore, StoredExamples, StoreWriter


def _written(tmp_path, processor, source, count=12):
    cfg = small_config()
    examples = generate([source], cfg.data.builtin, seed=0, count=count)[source]
    encoded = Encoder(processor, cfg.data.max_length).encode_counted(examples)
    with StoreWriter(tmp_path / source) as writer:
        for i in range(0, count, 4):  # appended a batch at a time, as prepare does
            writer.add(examples[i : i + 4], encoded[i : i + 4])
    return examples, encoded, SourceStore(tmp_path / source, source, f"builtin:{source}")


def test_rows_cut_into_shards_read_back_as_written(tmp_path, processor, monkeypatch):
    monkeypatch.setattr(store_module, "SHARD_ROWS", 5)
    examples, encoded, store = _written(tmp_path, processor, "caption")
    assert [p.name for p in sorted(store.folder.iterdir())] == [f"shard-0000{i}.arrow" for i in range(3)]
    assert len(store) == 12
    assert store.lengths().tolist() == [e.num_tokens for e in encoded]
    assert store.column_array("supervised").tolist() == [e.num_supervised for e in encoded]
    for row in (0, 4, 5, 11):  # either side of a shard's edge
        read, written = store.example(row), examples[row]
        assert (read.source, read.index, read.origin, read.messages) == (
            written.source,
            written.index,
            written.origin,
            written.messages,
        )
        assert torch.equal(read.token_ids, encoded[row].input_ids)
        assert read.images == written.images  # the drawing itself, drawn again when decoded
        assert np.array_equal(np.asarray(read.load_images()[0]), np.asarray(written.load_images()[0]))


def test_a_writer_stopped_by_an_error_leaves_no_folder(tmp_path, processor):
    cfg = small_config()
    examples = generate(["add_digits"], cfg.data.builtin, seed=0, count=4)["add_digits"]
    encoded = Encoder(processor, cfg.data.max_length).encode_counted(examples)
    with pytest.raises(KeyboardInterrupt), StoreWriter(tmp_path / "s") as writer:
        writer.add(examples, encoded)
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_view_joins_slices_and_pickles_as_indices(tmp_path, processor):
    a_examples, a_encoded, a = _written(tmp_path, processor, "caption", 6)
    b_examples, b_encoded, b = _written(tmp_path, processor, "add_words", 5)
    joined = StoredExamples.joined([StoredExamples.of(a, np.array([1, 3, 5])), StoredExamples.of(b, np.arange(5))])
    assert len(joined) == 8
    expected = [a_examples[i] for i in (1, 3, 5)] + b_examples
    assert [(ex.source, ex.index) for ex in joined] == [(ex.source, ex.index) for ex in expected]
    lengths = [a_encoded[i].num_tokens for i in (1, 3, 5)] + [e.num_tokens for e in b_encoded]
    assert joined.lengths().tolist() == lengths
    shard = joined[1::2]  # a DiLoCo worker's shard: every second example
    assert [ex.index for ex in shard] == [ex.index for ex in expected[1::2]]
    assert shard.lengths().tolist() == lengths[1::2]
    a.example(0)  # its shards mapped in this process: the pickle must not carry them
    copied = pickle.loads(pickle.dumps(joined))
    assert len(pickle.dumps(joined)) < 2000 and copied.stores[0]._batches is None
    assert torch.equal(copied[7].token_ids, b_encoded[4].input_ids)
