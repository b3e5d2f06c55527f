"""Creating a file only when none of its name exists, as one operation the store guarantees: how
a run takes its folder's lease when another run may take it at the same moment.

- A local folder: the whole record is written under a name of its own, then hard-linked to the
  name wanted (``link`` fails when the name exists; the record is whole whoever reads it).
- S3: a conditional ``PUT`` (``If-None-Match: *``), which AWS S3, GCS, MinIO, R2 and recent
  SeaweedFS honour: of two writers, one gets ``412 Precondition Failed``. A store that ignores
  the condition would overwrite silently, so each store is probed once (the same name created
  twice must fail the second time) before its answer is trusted.
- Any other store: no such operation (``None``); the caller says what it does instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import uuid
from typing import Any

from dcpkit.storage.fsspec import FsspecStore
from dcpkit.storage.local import LocalStore, write_durably

logger = logging.getLogger(__name__)

_honoured: dict[str, bool] = {}  # store root -> whether its conditional writes are honoured
_lock = threading.Lock()


def create_exclusive(store: Any, name: str, data: bytes) -> bool | None:
    """Create ``name`` in ``store`` holding ``data`` unless it exists: True when created, False
    when it existed (another writer's), None when the store cannot do it as one operation."""
    if isinstance(store, LocalStore):
        return _local(store, name, data)
    if isinstance(store, FsspecStore) and "s3" in store.fs.protocol:
        if not honours_conditional_writes(store):
            return None
        return _s3(store, name, data)
    return None


def honours_conditional_writes(store: Any) -> bool:
    """Whether ``store``'s conditional PUT refuses a name that exists (probed once per store)."""
    with _lock:
        known = _honoured.get(store.root)
    if known is not None:
        return known
    probe = f".dcpkit-probe-{uuid.uuid4().hex}"
    try:
        honoured = _s3(store, probe, b"1") and _s3(store, probe, b"2") is False
    except OSError as e:  # the condition refused outright (a 501): not honoured either
        logger.debug("checkpoint: %s refused a conditional write: %s", store.root, e)
        honoured = False
    finally:
        with contextlib.suppress(Exception):  # a probe left behind is harmless: nothing reads it
            store.remove(probe)
    with _lock:
        _honoured[store.root] = honoured
    return honoured


def _local(store: LocalStore, name: str, data: bytes) -> bool:
    path = store._p(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    whole = path.with_name(f".{path.name}.{uuid.uuid4().hex}.new")
    write_durably(whole, data)
    try:
        os.link(whole, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:  # a file system without hard links: create it exclusively instead
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True
    finally:
        whole.unlink(missing_ok=True)


def _s3(store: FsspecStore, name: str, data: bytes) -> bool:
    try:
        store.fs.pipe_file(store._p(name), data, mode="create")
    except OSError as e:
        if _precondition_failed(e):
            return False
        raise
    finally:
        store.fs.invalidate_cache(store._p(name))
    return True


def _precondition_failed(e: BaseException | None) -> bool:
    """``e`` (or what caused it) is the store's ``412 Precondition Failed``."""
    seen = 0
    while e is not None and seen < 8:
        response = getattr(e, "response", None)
        code = (response or {}).get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("PreconditionFailed", "412") or "PreconditionFailed" in str(e):
            return True
        e, seen = (e.__cause__ or e.__context__), seen + 1
    return False
