"""Parallel transfers to and from object stores: what a save writes leaves as parallel multipart
uploads while it is still being serialized, and what a load reads arrives as parallel ranged
GETs, each with a bounded number of parts in flight.

- **Uploads.** A file a DCP writer streams (``torch.save`` records, one after another) is cut
  into parts of ``UPLOAD_PART`` bytes (doubling every 1000 parts, S3's 10000-part limit is never
  reached), each uploaded as soon as it is full, at most ``UPLOADS_IN_FLIGHT`` at once per file;
  the writer waits when that many are on the wire. Nothing is copied to local disk: an
  asynchronous save uploads from its staging buffers. A file smaller than a part is one PUT. A
  failed upload is aborted (no parts are left behind); a file is visible only once complete.
- **Reads.** A reader says which byte spans of a file it will walk, in order; they are fetched
  as ``READ_PART``-byte ranged GETs, ``READS_IN_FLIGHT`` parts per loading rank (split between
  its reading threads) ahead of the reader: a load's memory beyond its destination tensors is
  bounded by ``READS_IN_FLIGHT * READ_PART`` (128 MiB) and the record headers requested ahead
  (``WINDOWS_AHEAD`` per file, 8 KiB each): the first and last 4 KiB of every ``torch.save``
  record (its zip headers), fetched in parallel ahead of the parse. A read elsewhere is a GET
  of its own (counted with the rest in ``Transport.bytes_read``).

On S3 (``s3://``) the requests go through botocore (the AWS SDK s3fs itself uses), one client
per store with the store's own credentials, endpoint and client options, read straight into
the reader's buffers; on other fsspec file systems through the file system's ``cat_file``. A
part that fails mid-transfer is fetched again (``ATTEMPTS`` times, with backoff); what still
fails raises, and the save's or load's own retries and messages take over.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcpkit.storage.randomness import imports_kept_off_stream

UPLOAD_PART = 16 << 20
UPLOADS_IN_FLIGHT = 8
READ_PART = 8 << 20
READS_IN_FLIGHT = 16
WINDOWS_AHEAD, WINDOWS_BEHIND = 512, 64  # record headers requested ahead of a parse, kept behind
HEAD = 4096  # the bytes of a record's start and end its parse reads (torchfile's _SCAN_READ)
ATTEMPTS = 4
_POOL_THREADS = 32

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process's transfer threads (made again in a forked child)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="dcpkit-transfer")
            _pool_pid = os.getpid()
        return _pool


class Transport:
    """Ranged reads and multipart uploads of one fsspec file system's objects."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.s3 = protocol in ("s3", "s3a")
        self._client: Any = None
        self._lock = threading.Lock()
        self.bytes_read = self.reads = 0  # counted: what loads took from the store
        self.reading = self.peak_reading = 0  # bytes being read now, and the most at once

    def client(self) -> Any:
        """A botocore S3 client configured as the store's s3fs one is."""
        with self._lock:
            if self._client is None:
                with imports_kept_off_stream():
                    self._client = _botocore_client(self.fs)
            return self._client

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def read_into(self, path: str, start: int, view: memoryview) -> None:
        """Bytes ``[start, start + len(view))`` of object ``path`` into ``view``."""
        if not len(view):
            return
        with self._lock:
            self.reads += 1
            self.reading += len(view)
            self.peak_reading = max(self.peak_reading, self.reading)
        try:
            self._read_into(path, start, view)
        finally:
            with self._lock:
                self.reading -= len(view)
                self.bytes_read += len(view)

    def _read_into(self, path: str, start: int, view: memoryview) -> None:
        for attempt in range(ATTEMPTS):
            try:
                if not self.s3:
                    data = self.fs.cat_file(path, start=start, end=start + len(view))
                    if len(data) != len(view):
                        raise EOFError(f"{path}: {len(data)} bytes at {start}, {len(view)} asked")
                    view[:] = data
                    return
                self._get_into(path, start, view)
                return
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as e:
                if attempt + 1 == ATTEMPTS or not retryable(e):
                    raise
                time.sleep(0.25 * 2**attempt)

    def _get_into(self, path: str, start: int, view: memoryview) -> None:
        bucket, key = self.split(path)
        end = start + len(view) - 1
        try:
            response = self.client().get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end}"
            )
        except Exception as e:
            raise translated(e, path) from None
        length, given = response.get("ContentLength"), str(response.get("ContentRange", ""))
        if length != len(view) and not given.startswith(f"bytes {start}-{end}/"):
            response["Body"].close()  # a server that ignored the range, or answered another
            raise EOFError(f"{path}: asked for bytes {start}-{end}, got {length} ({given})")
        body, got = response["Body"], 0
        reader = _socket_reader(body)  # straight into ``view``: no bytes object per read
        try:
            while got < len(view):
                n = reader(view[got:])
                if not n:
                    raise EOFError(f"{path}: the object ends at byte {start + got}")
                got += n
        finally:
            _finish(body, reader, got)

    def read(self, path: str, start: int, end: int) -> bytearray:
        buf = bytearray(end - start)
        self.read_into(path, start, memoryview(buf))
        return buf


def _socket_reader(body: Any) -> Any:
    """``readinto`` of the HTTP response under botocore's body when its bytes arrive as they
    are (no content encoding): received into the caller's buffer. Else the body's own read."""
    raw = getattr(body, "_raw_stream", None)  # urllib3's response
    fp = getattr(raw, "_fp", None)  # http.client's
    plain = raw is not None and not raw.headers.get("content-encoding")
    if plain and getattr(raw, "_decoder", None) is None and hasattr(fp, "readinto"):
        return fp.readinto
    if raw is not None:
        return raw.readinto
    return lambda view: _read_some(body, view)


def _finish(body: Any, reader: Any, got: int) -> None:
    """Done with ``body``: its connection back to the pool when every byte was read through
    http.client (urllib3 then counts them as read), else closed."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is not None and reader == getattr(fp, "readinto", None) and fp.isclosed():
        raw._fp_bytes_read += got
        raw.release_conn()
        return
    body.close()


def _read_some(body: Any, view: memoryview) -> int:
    data = body.read(len(view))
    view[: len(data)] = data
    return len(data)


def retryable(e: BaseException) -> bool:
    names = {"ClientError"}
    if type(e).__name__ in names:
        status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status in (408, 429)
    return True  # connection reset, timeouts, a body cut short


def translated(e: Exception, path: str) -> Exception:
    """botocore's not-found and denied as Python's own errors (the types s3fs raises)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "NoSuchBucket", "404") or status == 404:
            return FileNotFoundError(f"{path}: no such object ({code or status})")
        if code in ("AccessDenied", "403") or status == 403:
            return PermissionError(f"{path}: access denied ({code or status})")
    return e


def _botocore_client(fs: Any) -> Any:
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.session import get_session

    options = dict(getattr(fs, "config_kwargs", None) or {})
    options.setdefault("max_pool_connections", _POOL_THREADS)
    # Integrity is the manifest's xxh3 of every file, checked on load: no CRC-32 of every part.
    options.setdefault("request_checksum_calculation", "when_required")
    options.setdefault("response_checksum_validation", "when_required")
    if getattr(fs, "anon", False):
        options["signature_version"] = UNSIGNED
    kwargs = dict(getattr(fs, "client_kwargs", None) or {})
    for name, value in (
        ("aws_access_key_id", getattr(fs, "key", None)),
        ("aws_secret_access_key", getattr(fs, "secret", None)),
        ("aws_session_token", getattr(fs, "token", None)),
        ("endpoint_url", getattr(fs, "endpoint_url", None)),
    ):
        if value is not None:
            kwargs.setdefault(name, value)
    profile = (getattr(fs, "kwargs", None) or {}).get("profile")
    session = get_session()
    if profile:
        session.set_config_variable("profile", profile)
    return session.create_client("s3", config=Config(**options), **kwargs)
