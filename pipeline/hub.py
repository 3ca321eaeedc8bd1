"""Models named by a Hugging Face id or a folder: where their files are on this machine.

Every stage reads θ0 as a local folder (the merge reader opens safetensors files, the Fisher and
calibration stages load the model, the branches start from it), so a hub id is resolved once, to
its snapshot in the local cache, through ``huggingface_hub``. Offline (``HF_HUB_OFFLINE=1``, as
``make`` sets it) only the cache is looked at, and a model that is not there is an error that
names the id and the command that downloads it: checked when a flow starts, before any training.
Online, a run downloads a missing snapshot (weights as safetensors only, never pickles); ``merit
check`` never does: it names what the cache lacks either way, and online also what the hub says of
it (gated, and whether the token here may read it: :func:`hub_access`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

from pipeline.config import ConfigError

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
# A snapshot as transformers needs it: configs, tokenizer and processor files, safetensors weights,
# and a model's own code (run only with model.trust_remote_code).
FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken", "*.py"]


class ModelNotFoundError(ConfigError):
    """A model id or folder that does not lead to a loadable checkpoint on this machine."""


def hub_cache() -> Path:
    """The hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    return Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub")


def datasets_cache() -> Path:
    """Where ``datasets`` keeps the data sets it built, as the environment names it now."""
    return Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets")


def _hf_home() -> Path:
    return Path(
        os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    )


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}


_CACHE_ONLY = ContextVar("cache_only", default=False)


@contextmanager
def cache_only() -> Iterator[None]:
    """Within it, online or not, a hub id resolves to this machine's cache and nothing is
    downloaded: what ``merit check`` and the commands that only read a run look at."""
    token = _CACHE_ONLY.set(True)
    try:
        yield
    finally:
        _CACHE_ONLY.reset(token)


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """The local folder of a model folder or hub id; an error naming it when there is none.
    Online (and outside :func:`cache_only`) a snapshot the cache lacks is downloaded."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_model_folder(path.resolve())
    if not REPO_ID.fullmatch(name_or_path):
        raise ModelNotFoundError(f"model {name_or_path}: no such folder, and not a Hugging Face id (organisation/name)")
    cache = hub_cache()
    local_only = offline() or _CACHE_ONLY.get()
    try:
        folder = snapshot_download(
            name_or_path, revision=revision, cache_dir=cache, allow_patterns=FILES, local_files_only=local_only
        )
    except LocalEntryNotFoundError:  # offline, a check, or online with the hub out of reach
        where = f"revision {revision} of " if revision else ""
        why = (
            " and HF_HUB_OFFLINE is set" if offline() else "" if _CACHE_ONLY.get() else " and the hub cannot be reached"
        )
        raise ModelNotFoundError(
            f"model {name_or_path}: {where}it is not in the Hugging Face cache {cache}{why}. "
            f"Download it first: `hf download {name_or_path}` (with HF_HOME pointing at the cache every machine of "
            f"the run reads){hub_access(name_or_path, 'model')}"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise ModelNotFoundError(f"model {name_or_path}: cannot get it from the Hugging Face hub: {err}") from None
    return check_model_folder(Path(folder))


def hub_access(repo_id: str, repo_type: str) -> str:
    """What the hub says of a repository the cache lacks, `` (…)`` to add to an error: whether it
    exists, whether it is gated and, if so, whether this machine's token (``HF_TOKEN`` or ``hf auth
    login``) may download it. Empty offline (only the cache is known) and for an open one."""
    if offline():
        return ""
    api, page = HfApi(), f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        gated = api.repo_info(repo_id, repo_type=repo_type, timeout=10).gated
        if gated:
            api.auth_check(repo_id, repo_type=repo_type)
    except GatedRepoError:
        return (
            f" (gated: accept its terms at {page} and log in with that account, `hf auth login` or HF_TOKEN, "
            "before downloading; the token here has no access)"
        )
    except RepositoryNotFoundError:
        return " (the hub has no such repository, or it is private and the token here cannot see it)"
    except Exception as err:
        # The hub out of reach (however huggingface_hub's HTTP client of the day says so), or
        # refusing: this only adds to an error about the cache, whose answer stands alone.
        return f" (the hub could not be asked whether it is gated: {type(err).__name__})"
    return " (gated; the token here has access)" if gated else ""


def dataset_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of a hub data set in the local cache (as ``hf download ID --repo-type dataset``
    leaves it); None when it is not there. Never downloads."""
    try:
        folder = snapshot_download(
            repo_id, repo_type="dataset", revision=revision, cache_dir=hub_cache(), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    return Path(folder)


def dataset_built(repo_id: str, name: str | None = None, cache_dir: str | None = None) -> bool:
    """Whether ``datasets`` built (this config of) a hub data set in its own cache, where its
    offline fallback finds it: ``ORG___name_in_snake_case/<config>/<version>/<hash>/``."""
    from datasets.naming import camelcase_to_snakecase

    org, dataset = repo_id.split("/")
    root = Path(cache_dir or datasets_cache()).expanduser() / f"{org}___{camelcase_to_snakecase(dataset)}"
    return any(p.is_dir() for p in root.glob(f"{name or '*'}/*/*"))


def check_model_folder(folder: Path) -> Path:
    """A folder transformers can load: a config and safetensors weights (pickled weights are refused)."""
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model folder {folder}: no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {folder}: no safetensors weights (pickled .bin files are refused)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if missing := sorted(s for s in shards if not (folder / s).is_file()):
            raise ModelNotFoundError(f"model folder {folder}: shards {missing} of its index are missing")
    return folder
