"""Checkpoints on object stores and other fsspec file systems (``s3://``, ``gs://``,
``memory://``, ...).

Rename is not atomic on an object store, so a remote checkpoint is published differently: every
rank's data, ``.metadata`` and the manifest are uploaded straight into ``step-N/``, and a commit
marker, written last, makes it a checkpoint. Discovery sees only folders with the marker;
folders without it are abandoned uploads, removed by the next run. Retention deletes the marker
first, so a half-deleted checkpoint is never taken for a complete one.

Credentials and endpoint come from the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ...) or from ``[checkpoint] storage_options``,
passed to fsspec as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from dcpkit.integrity import CHECKSUM_ALGORITHM, MANIFEST_SEAL, Problem, _seal
from dcpkit.layout import COMMIT_MARKER, MANIFEST, STEP_DIR_RE

logger = logging.getLogger(__name__)

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """An fsspec URL other than ``file://`` (local paths keep dcpkit's rename-based publish)."""
    text = str(path)
    return bool(_URL.match(text)) and not text.startswith("file://")


class RemoteError(RuntimeError):
    """A remote location cannot be used; the message names the URL and what to check."""


@dataclass
class Remote:
    """An fsspec file system and a root URL on it."""

    url: str
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        try:
            import fsspec
        except ImportError:
            raise RemoteError(
                f"{self.url}: remote storage needs fsspec and the file system's package "
                "(pip install 'dcpkit[remote]', i.e. fsspec and s3fs)"
            ) from None
        self.url = self.url.rstrip("/")
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **(self.storage_options or {}))
        except (ImportError, ValueError) as e:
            raise RemoteError(f"{self.url}: {e}") from None

    def child(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _p(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def check_reachable(self) -> None:
        """Fail early, naming the URL, on a missing bucket or rejected credentials."""
        bucket = self.path.split("/", 1)[0]
        if self.fs.protocol in ("memory",) or "memory" in self.fs.protocol:
            return
        try:
            self.fs.ls(bucket, detail=False, refresh=True)
        except FileNotFoundError:
            raise RemoteError(
                f"{self.url}: the bucket {bucket!r} does not exist; create it or fix the URL"
            ) from None
        except PermissionError as e:
            raise RemoteError(
                f"{self.url}: the credentials were rejected ({e}); check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL) or [checkpoint] storage_options"
            ) from None
        except Exception as e:  # botocore/s3fs errors vary by version
            raise RemoteError(_explain(self.url, e)) from None

    # -- listing

    def ls_names(self, *parts: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(*parts), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise RemoteError(_explain(self.child(*parts), e)) from None
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def exists(self, *parts: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self._p(*parts))

    def size(self, *parts: str) -> int:
        return int(self.fs.info(self._p(*parts))["size"])

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open(self._p(*parts), "rb") as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        with self.fs.open(self._p(*parts), "wb") as f:
            f.write(data)

    def checksum(self, *parts: str) -> str:
        h = xxhash.xxh3_64()
        with self.fs.open(self._p(*parts), "rb", block_size=8 << 20) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        return h.hexdigest()

    def rm(self, *parts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._p(*parts), recursive=True)

    # -- checkpoints under this root

    def step_folders(self) -> dict[int, bool]:
        """``{step: committed}`` for every ``step-N`` folder."""
        out = {}
        for name in self.ls_names():
            m = STEP_DIR_RE.match(name)
            if m:
                out[int(m.group(1))] = COMMIT_MARKER in self.ls_names(name)
        return out

    def published_steps(self) -> list[int]:
        return sorted(s for s, committed in self.step_folders().items() if committed)

    def remove_abandoned(self) -> list[int]:
        abandoned = sorted(s for s, committed in self.step_folders().items() if not committed)
        for step in abandoned:
            logger.warning(
                "removing %s, an upload that never committed", self.child(f"step-{step}")
            )
            self.rm(f"step-{step}")
        return abandoned

    def apply_retention(self, keep_latest_k: int) -> list[int]:
        if keep_latest_k <= 0:
            return []
        steps = self.published_steps()
        doomed = steps[:-keep_latest_k] if len(steps) > keep_latest_k else []
        for step in doomed:
            self.rm(f"step-{step}", COMMIT_MARKER)  # uncommit first: never half-deleted
            self.rm(f"step-{step}")
        return doomed

    def download(self, name: str, dest: Path) -> Path:
        """Copy folder ``name`` (or the root when empty) to ``dest``, file by file."""
        dest.mkdir(parents=True, exist_ok=True)
        for file in self.ls_names(*([name] if name else [])):
            parts = [name, file] if name else [file]
            self.fs.get(self._p(*parts), str(dest / file))
        return dest


def _explain(url: str, e: Exception) -> str:
    text = str(e) or type(e).__name__
    lowered = text.lower()
    if any(
        s in lowered
        for s in (
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "access denied",
            "accessdenied",
            "forbidden",
            "credentials",
        )
    ):
        return (
            f"{url}: the credentials were rejected ({text}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or [checkpoint] storage_options"
        )
    if "bucket" in lowered and ("not exist" in lowered or "nosuchbucket" in lowered):
        return f"{url}: the bucket does not exist ({text}); create it or fix the URL"
    return f"{url}: {type(e).__name__}: {text}"


# --- writing one step ----------------------------------------------------------------------------


class RemoteTarget:
    """Publish by commit marker: upload into ``step-N/``, the manifest, then the marker last
    (``publish.write_and_publish`` calls these in order)."""

    def __init__(self, info: Any) -> None:
        self.info = info
        self.remote = Remote(info.url, info.storage_options)
        self.name = f"step-{info.step}"

    def prepare(self) -> None:
        if self.remote.exists(self.name):
            self.remote.rm(self.name)  # an abandoned upload of this step, or a re-save

    def writer(self) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.remote.child(self.name), **(self.info.storage_options or {}))

    def own_files(self, rank: int) -> list[str]:
        return [f for f in self.remote.ls_names(self.name) if f.startswith(f"__{rank}_")]

    def describe(self, names: list[str]) -> dict[str, Any]:
        return {
            f: {
                "size": self.remote.size(self.name, f),
                CHECKSUM_ALGORITHM: self.remote.checksum(self.name, f),
            }
            for f in names
        }

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        sealed = {**manifest, MANIFEST_SEAL: _seal(manifest)}
        self.remote.write_bytes(
            json.dumps(sealed, indent=1, sort_keys=True).encode(), self.name, MANIFEST
        )

    def commit(self) -> None:
        self.remote.write_bytes(b"", self.name, COMMIT_MARKER)

    def retention(self) -> list[int]:
        return self.remote.apply_retention(self.info.keep_latest_k)


def verify_remote(remote: Remote, name: str, names: list[str] | None = None) -> list[Problem]:
    """Marker, manifest, sizes and checksums of ``name`` on the remote (``names``: only these
    files' checksums)."""
    problems = []
    files = remote.ls_names(name)
    if COMMIT_MARKER not in files:
        problems.append(Problem(COMMIT_MARKER, "is missing: the upload never committed"))
    if MANIFEST not in files:
        problems.append(Problem(MANIFEST, "is missing: checksums cannot be checked"))
        return problems
    try:
        manifest = json.loads(remote.read_bytes(name, MANIFEST))
    except ValueError as e:
        return [*problems, Problem(MANIFEST, f"cannot be parsed ({e})")]
    if manifest.get(MANIFEST_SEAL) != _seal(manifest):
        problems.append(Problem(MANIFEST, "was altered: its content does not match its checksum"))
    for file, expected in manifest["files"].items():
        if file not in files:
            problems.append(Problem(file, "is missing"))
            continue
        if remote.size(name, file) != expected["size"]:
            problems.append(Problem(file, "has the wrong size: truncated or replaced"))
        elif (names is None or file in names) and (
            remote.checksum(name, file) != expected[CHECKSUM_ALGORITHM]
        ):
            problems.append(Problem(file, "checksum mismatch"))
    return problems


def copy_path(copy: tempfile.TemporaryDirectory, url: str) -> Path:
    """Where the local copy (``materialize``, ``fetch_skeleton``, ``stream_copy``) of ``url``
    lies: its last path component, in the temporary folder."""
    return Path(copy.name) / url.rstrip("/").rsplit("/", 1)[-1]


def materialize(url: str, storage_options: dict | None = None) -> tempfile.TemporaryDirectory:
    """Download a remote checkpoint folder (or file) to a temporary folder for the tools that
    read local files. The caller keeps the returned object alive while it reads."""
    remote = Remote(url, storage_options)
    remote.check_reachable()
    tmp = tempfile.TemporaryDirectory(prefix="dcpkit-remote-")
    if remote.fs.isfile(remote.path):
        remote.fs.get(remote.path, str(copy_path(tmp, url)))
    else:
        if not remote.fs.exists(remote.path):
            raise FileNotFoundError(f"{url} does not exist")
        remote.download("", copy_path(tmp, url))
    return tmp


_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit
_SMALL_FILE = 64 << 20  # other files up to this size are copied (metadata, configs, tokenizers)


def fetch_skeleton(url: str, storage_options: dict | None = None) -> tempfile.TemporaryDirectory:
    """A metadata-only local copy of a remote checkpoint folder, for the tools that read no
    tensor data (``inspect``, and ``verify`` with the checksums computed remotely): small files
    in full; ``.distcp`` files and other large files as sparse files of their true size;
    ``.safetensors`` files as their header in a sparse file of their true size. A single file is
    downloaded whole."""
    remote = Remote(url, storage_options)
    remote.check_reachable()
    if remote.fs.isfile(remote.path) or not remote.fs.exists(remote.path):
        return materialize(url, storage_options)
    tmp = tempfile.TemporaryDirectory(prefix="dcpkit-remote-")
    dest = copy_path(tmp, url)
    dest.mkdir()
    for entry in remote.fs.ls(remote.path, detail=True, refresh=True):
        if entry.get("type") != "file":
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        size, local = int(entry["size"]), dest / name
        if name.endswith(".distcp") or (size > _SMALL_FILE and not name.endswith(".safetensors")):
            with open(local, "wb") as f:
                f.truncate(size)
        elif name.endswith(".safetensors"):
            with remote.fs.open(remote._p(name), "rb") as src, open(local, "wb") as f:
                head = src.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                f.write(head)
                if 0 < n <= min(_SAFETENSORS_HEADER_MAX, size - 8):
                    f.write(src.read(n))
                f.truncate(size)
        else:
            remote.fs.get(remote._p(name), str(local))
    return tmp


_STREAM_BLOCK = 4 << 20  # range request size when tensors are read from the remote files
_STREAM_BLOCKS = 8  # blocks cached per open file: 32 MiB


def stream_copy(url: str, storage_options: dict | None = None) -> tempfile.TemporaryDirectory:
    """A metadata-only local copy (``fetch_skeleton``) whose data files the readers read from
    the remote originals, by range requests, as tensors are asked for: a conversion or a diff
    of a remote checkpoint needs neither its size in local disk nor a download first."""
    from dcpkit.files import register_origin

    tmp = fetch_skeleton(url, storage_options)
    local = copy_path(tmp, url)
    if local.is_dir():
        remote = Remote(url, storage_options)

        def opener(name: str) -> Any:
            return remote.fs.open(
                remote._p(name),
                "rb",
                block_size=_STREAM_BLOCK,
                cache_type="blockcache",
                cache_options={"maxblocks": _STREAM_BLOCKS},
            )

        register_origin(local, opener)
    return tmp


def verify_url(url: str, checksums: bool = True, storage_options: dict | None = None) -> Any:
    """``verify`` of a remote checkpoint: structure and sizes from a metadata-only copy, and
    checksums streamed from the remote files (nothing is stored locally)."""
    from dcpkit.verify import verify_path

    remote = Remote(url, storage_options)
    tmp = fetch_skeleton(url, storage_options)
    try:
        local = copy_path(tmp, url)
        if local.is_file():
            report = verify_path(local)  # a single file: downloaded whole, checked locally
        else:
            report = verify_path(local, checksums=checksums, checksum_of=remote.checksum)
            if (
                STEP_DIR_RE.match(local.name)
                and (local / MANIFEST).is_file()
                and not (local / COMMIT_MARKER).is_file()
            ):
                report.notes.append(
                    f"no {COMMIT_MARKER}: the upload never committed, so training does not "
                    "pick this step"
                )
    finally:
        tmp.cleanup()
    report.path = url
    return report
