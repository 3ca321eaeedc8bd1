import json
import os
import shutil

import pytest

from pipeline import checkpoint
from pipeline.checkpoint import (
    CheckpointError,
    bytes_hashed,
    is_complete,
    replacing,
    staged_dir,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
    write_text_atomic,
)


def test_staged_dir_is_all_or_nothing(tmp_path):
    dst = tmp_path / "ckpt"
    with pytest.raises(RuntimeError), staged_dir(dst) as tmp:
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []


def test_staged_dir_replaces_an_existing_checkpoint(tmp_path):
    dst = tmp_path / "ckpt"
    for payload in (b"old", b"new"):
        with staged_dir(dst) as tmp:
            (tmp / "weights.bin").write_bytes(payload)
            write_manifest(tmp, step=len(payload))
    assert (dst / "weights.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_manifest_detects_corruption_and_missing_files(tmp_path):
    with staged_dir(tmp_path / "c") as tmp:
        (tmp / "a.bin").write_bytes(b"0123456789")
        write_manifest(tmp, step=3)
    assert verify_checkpoint(tmp_path / "c")["step"] == 3
    (tmp_path / "c" / "a.bin").write_bytes(b"01234")  # truncated
    with pytest.raises(CheckpointError, match="a.bin"):
        verify_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "a.bin").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(tmp_path / "c")
    assert not is_complete(tmp_path / "nothing-here")


def test_next_writer_removes_leftovers_of_a_killed_writer(tmp_path):
    (tmp_path / ".ckpt.tmp-1234abcd").mkdir()  # what a SIGKILL mid-write leaves
    (tmp_path / "other").mkdir()
    with staged_dir(tmp_path / "ckpt") as tmp:
        write_manifest(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "other"]


def test_a_kill_between_the_renames_keeps_the_old_checkpoint(tmp_path):
    with staged_dir(tmp_path / "ckpt") as tmp:
        (tmp / "w.bin").write_bytes(b"old")
        write_manifest(tmp)
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-1234abcd")  # the state right after the first rename
    with pytest.raises(RuntimeError), staged_dir(tmp_path / "ckpt"):
        raise RuntimeError("the next writer fails")
    assert (tmp_path / "ckpt" / "w.bin").read_bytes() == b"old" and is_complete(tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_checkpoint_is_hashed_once_and_again_only_when_a_file_changes(tmp_path, monkeypatch):
    """Every rank, stage and merge verifies θ0 and the branches: a multi-GB checkpoint must be
    read once per run, not once per verification."""
    with staged_dir(tmp_path / "c") as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 1000)
        (tmp / "b.bin").write_bytes(b"y" * 500)
        write_manifest(tmp, step=1)
    hashed = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    for _ in range(3):
        verify_checkpoint(tmp_path / "c")
    assert hashed == []  # hashed when written, and recorded
    stat = (tmp_path / "c" / "a.bin").stat()
    os.utime(tmp_path / "c" / "a.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: check again
    verify_checkpoint(tmp_path / "c")
    verify_checkpoint(tmp_path / "c")
    assert sorted(hashed) == ["a.bin", "b.bin"]
    (tmp_path / "c" / "b.bin").write_bytes(b"z" * 500)  # same size, rewritten: caught
    with pytest.raises(CheckpointError, match="b.bin: sha256 does not match"):
        verify_checkpoint(tmp_path / "c")
    assert bytes_hashed(tmp_path) == {
        "write_bytes_hashed": 1500,
        "verify_bytes_hashed": 1500,
        "verifications": 1,
        "checkpoints": 1,
    }


def test_a_copy_is_hashed_again_even_with_its_record_and_mtimes(tmp_path):
    """`cp -a` and copytree keep mtimes and copy the record: a copy must still be checked."""
    with staged_dir(tmp_path / "c") as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 100)
        write_manifest(tmp, step=1)
    shutil.copytree(tmp_path / "c", tmp_path / "copy")
    copied = tmp_path / "copy" / "a.bin"
    stat = copied.stat()
    copied.write_bytes(b"y" + b"x" * 99)  # the same size, one byte flipped, the mtime put back
    os.utime(copied, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CheckpointError, match="a.bin: sha256 does not match"):
        verify_checkpoint(tmp_path / "copy")
    verify_checkpoint(tmp_path / "c")  # the original is untouched


def test_a_file_written_atomically_is_the_old_one_or_the_new_one(tmp_path):
    path = tmp_path / "report.md"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError, match="killed"), replacing(path) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("killed while writing")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
    write_json_atomic(path, {"new": 1})
    assert json.loads(path.read_text()) == {"new": 1} and len(list(tmp_path.iterdir())) == 1
