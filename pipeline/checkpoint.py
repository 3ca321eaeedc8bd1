"""Checkpoint folders that exist whole or not at all.

A checkpoint is a ``save_pretrained`` folder plus ``manifest.json`` (sha256 of every file and
metadata such as step, tokens seen and parent). It is written under a hidden temporary name in
the same parent folder and renamed into place, so a crash or a SIGKILL never leaves a folder
that looks complete. Pure standard library: the merge library imports this too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # the record of the last verification (see verify_checkpoint)
HASH_COUNTS = ("write_bytes_hashed", "verify_bytes_hashed")
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (hidden, a name of its own: writers never share one) to
    write; on success it replaces ``path`` in one rename, on an exception it is removed. A reader
    sees the old file or the new one, never half of either. The one atomic writer of files:
    JSON, text, figures (``pipeline.figures``); folders are ``staged_dir``'s."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False))


@contextlib.contextmanager
def staged_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces ``dst`` in one rename.

    On an exception the temporary folder is removed and ``dst`` is left as it was. A kill
    leaves only a hidden ``.name.tmp-*`` folder; the next writer of ``dst`` removes it (one
    writer per checkpoint path at a time is the contract).
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for leftover in dst.parent.glob(f".{dst.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    olds = sorted(dst.parent.glob(f".{dst.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not dst.exists():  # killed between the two renames below: the old one is whole
        olds.pop().rename(dst)
    for leftover in olds:
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        # rename() cannot replace a non-empty folder: move the old one aside first so that
        # at every instant either the old or the new checkpoint is complete under some name.
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dst)


def write_manifest(folder: str | Path, known_hashes: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    """Hash every file in ``folder`` (except those whose sha256 the writer already computed
    while writing them) and write ``manifest.json`` beside them. The folder counts as verified
    from then on: its files were hashed as they are."""
    folder = Path(folder)
    known = known_hashes or {}
    files, hashed = {}, 0
    for p in sorted(folder.rglob("*")):
        name = str(p.relative_to(folder))
        if p.is_file() and p.name not in (MANIFEST, VERIFIED):
            files[name] = known[name] if name in known else sha256_file(p)
            hashed += p.stat().st_size
    manifest = {**meta, "files": files}
    write_json_atomic(folder / MANIFEST, manifest)
    _record_verification(folder, _stamps(folder, manifest), write_bytes_hashed=hashed)
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST}, not a complete checkpoint")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from err


def verify_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Check every file listed in the manifest against its sha256; return the manifest.

    A multi-GB checkpoint is read by every rank, stage and merge of a run: it is hashed once, and
    the verification is recorded in the folder (``.verified.json``: each file's size, mtime,
    inode and ctime). Later calls compare those only, and hash again when one has changed, so a
    file rewritten, truncated or copied in after the check is still caught, at the cost of a stat
    per file."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    stamps = _stamps(folder, manifest)
    if _verified(folder).get("stamps") == stamps:
        return manifest
    hashed = 0
    for name, expected in manifest["files"].items():
        path = folder / name
        if sha256_file(path) != expected:
            raise CheckpointError(f"{path}: sha256 does not match the manifest (corrupt or truncated)")
        hashed += path.stat().st_size
    if _stamps(folder, manifest) == stamps:  # not rewritten while it was hashed
        _record_verification(folder, stamps, verify_bytes_hashed=hashed)
    return manifest


def _stamps(folder: Path, manifest: dict[str, Any]) -> dict[str, list[int]]:
    """Size, mtime, inode and ctime of every file: a copy (new inodes and ctimes, even when
    ``cp -a`` keeps the mtimes) or a rewrite is hashed again; only an untouched file is not."""
    stamps = {}
    for name in [*manifest["files"], MANIFEST]:
        try:
            stat = (folder / name).stat()
        except FileNotFoundError:
            raise CheckpointError(f"{folder / name}: listed in the manifest but missing") from None
        stamps[name] = [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
    return stamps


_in_process: dict[str, dict[str, Any]] = {}  # the records of folders this process cannot write to


def _verified(folder: Path) -> dict[str, Any]:
    if (kept := _in_process.get(str(folder.resolve()))) is not None:
        return kept
    try:
        return json.loads((folder / VERIFIED).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _record_verification(folder: Path, stamps: dict[str, list[int]], **hashed: int) -> None:
    """Note that the files with these stamps match the manifest; count the bytes hashed for it.
    (Two processes verifying at once may both hash and one count be lost: the launcher verifies
    θ0 before its ranks start, so in a run they do not.)"""
    old = _verified(folder)
    record = {
        "stamps": stamps,
        **{key: old.get(key, 0) + hashed.get(key, 0) for key in HASH_COUNTS},
        "verifications": old.get("verifications", 0) + ("verify_bytes_hashed" in hashed),
    }
    try:
        write_json_atomic(folder / VERIFIED, record)
    except OSError:  # a read-only copy of θ0: remember it for this process only
        _in_process[str(folder.resolve())] = record


def bytes_hashed(root: str | Path) -> dict[str, int]:
    """Bytes hashed to write and to verify every checkpoint under ``root`` (a run directory)."""
    totals = dict.fromkeys((*HASH_COUNTS, "verifications", "checkpoints"), 0)
    for path in Path(root).rglob(VERIFIED):
        record = _verified(path.parent)
        for key in (*HASH_COUNTS, "verifications"):
            totals[key] += record.get(key, 0)
        totals["checkpoints"] += 1
    return totals


def checkpoint_id(checkpoint: str | Path) -> str:
    """The identity of the weights: the hash of a project checkpoint's manifest (which hashes
    every file); for a Hugging Face snapshot its repository and revision (the same on every
    machine, wherever its cache is); else the path as given."""
    path = Path(checkpoint)
    if (path / MANIFEST).is_file():
        return sha256_file(path / MANIFEST)
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return f"{parts[-3].removeprefix('models--').replace('--', '/')}@{parts[-1]}"
    return str(checkpoint)


def source_of(checkpoint: str | Path) -> Path:
    """The checkpoint whose tensors ``checkpoint`` must hold: the source its manifest names (the model a
    warm-up, branch or merge came from; recorded by the writer) where this machine has that folder, else
    ``checkpoint`` itself (a hub snapshot, a folder without our manifest: its own source)."""
    path = Path(checkpoint)
    recorded = json.loads((path / MANIFEST).read_text()).get("source") if (path / MANIFEST).is_file() else None
    return Path(recorded) if recorded and Path(recorded).is_dir() else path


def is_complete(folder: str | Path) -> bool:
    try:
        verify_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def save_pretrained_checkpoint(
    dst: str | Path, model: Any, processor: Any = None, state_dict: dict | None = None, **meta: Any
) -> Path:
    """``save_pretrained`` a model (its own weights, or ``state_dict`` in its layout) and processor
    atomically, with a manifest."""
    dst = Path(dst)
    with staged_dir(dst) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if processor is not None:
            processor.save_pretrained(tmp)
        write_manifest(tmp, **meta)
    return dst
