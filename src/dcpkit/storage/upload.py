"""Files uploaded as they are written: parallel multipart uploads fed by a DCP writer's stream
(see ``dcpkit.storage.transfer``)."""

from __future__ import annotations

import collections
import contextlib
import io
import time
from concurrent.futures import Future
from typing import Any

from dcpkit.storage.transfer import (
    ATTEMPTS,
    UPLOAD_PART,
    UPLOADS_IN_FLIGHT,
    Transport,
    pool,
    retryable,
    translated,
)


class PartUpload(io.RawIOBase):
    """A file written as a stream and uploaded in parts as it is written (see the module)."""

    def __init__(self, transport: Transport, path: str) -> None:
        self.transport, self.path = transport, path
        self.bucket, self.key = transport.split(path)
        self.buf = bytearray()
        self.pos = 0
        self.upload_id: str | None = None
        self.sent: collections.deque[Future[dict[str, Any]]] = collections.deque()
        self.parts: list[dict[str, Any]] = []
        self.done = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if (whence, offset) in ((io.SEEK_SET, self.pos), (io.SEEK_CUR, 0), (io.SEEK_END, 0)):
            return self.pos
        raise io.UnsupportedOperation(f"{self.path}: an upload is written in order")

    def _part_size(self) -> int:
        return UPLOAD_PART << min(10, (len(self.parts) + len(self.sent)) // 1000)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        while len(view):
            take = min(len(view), self._part_size() - len(self.buf))
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) >= self._part_size():
                self._send()
        self.pos += n
        return n

    def _client(self) -> Any:
        return self.transport.client()

    def _send(self) -> None:
        if self.upload_id is None:
            try:
                mpu = self._client().create_multipart_upload(Bucket=self.bucket, Key=self.key)
            except Exception as e:
                raise translated(e, self.path) from None
            self.upload_id = mpu["UploadId"]
        data, self.buf = self.buf, bytearray()
        number = len(self.parts) + len(self.sent) + 1
        while len(self.sent) >= UPLOADS_IN_FLIGHT:
            self.parts.append(self.sent.popleft().result())
        self.sent.append(pool().submit(self._upload_part, number, data))

    def _upload_part(self, number: int, data: bytearray) -> dict[str, Any]:
        for attempt in range(ATTEMPTS):
            try:
                out = self._client().upload_part(
                    Bucket=self.bucket,
                    Key=self.key,
                    PartNumber=number,
                    UploadId=self.upload_id,
                    Body=data,
                )
                return {"PartNumber": number, "ETag": out["ETag"]}
            except Exception as e:
                if attempt + 1 == ATTEMPTS or not retryable(e):
                    raise translated(e, self.path) from None
                time.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self.done:
                self._finish()
        finally:
            super().close()

    def _finish(self) -> None:
        self.done = True
        try:
            if self.upload_id is None:  # smaller than a part: one request
                self._client().put_object(Bucket=self.bucket, Key=self.key, Body=self.buf)
                return
            if self.buf:
                self._send()
            while self.sent:
                self.parts.append(self.sent.popleft().result())
            self._client().complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": sorted(self.parts, key=lambda p: p["PartNumber"])},
            )
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception):
                raise translated(e, self.path) from None
            raise

    def abort(self) -> None:
        """Give the upload up: parts on the wire cancelled or waited for, the upload aborted."""
        self.done = True
        for future in self.sent:
            future.cancel()
        for future in self.sent:
            with contextlib.suppress(BaseException):
                future.result()
        self.sent.clear()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self._client().abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
                )
        self.buf = bytearray()


def fs_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The file system's options: on S3 with no listing cache (every listing is asked for
    afresh anyway; a cached one, stored by one thread while another wrote into the folder,
    made that writer's rename of a file it had just written fail: not found)."""
    if url.split("://", 1)[0] in ("s3", "s3a"):
        return {"use_listings_cache": False, **options}
    return options


def upload_file_system(fs: Any, transport: Transport, digests: dict[str, tuple[str, int]]) -> Any:
    """DCP's fsspec file system on ``fs`` whose written files are uploaded in parallel parts (on
    S3) and hashed as they are written, each one's (xxh3-64, size) recorded in ``digests``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    from dcpkit.manifest import hashed_stream

    class UploadFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if "w" not in mode or not transport.s3:
                with (
                    super().create_stream(path, mode) as raw,
                    hashed_stream(raw, mode, digests, path) as stream,
                ):
                    yield stream
                return
            upload = PartUpload(transport, str(fs._strip_protocol(str(path))))
            try:
                with hashed_stream(upload, mode, digests, path) as stream:
                    yield stream
                upload.close()
            except BaseException:
                upload.abort()
                raise
            finally:
                fs.invalidate_cache(upload.path)  # listings see the new object

    out = UploadFileSystem()
    out.fs = fs
    return out


def step_writer(location: str, storage_options: dict[str, Any], step: int | None) -> Any:
    """DCP's fsspec writer of ``location`` with the ``mid_write`` crash point; no fsync (the
    commit marker, written last, is what makes a step durable); its ``fs`` is then set to
    ``upload_file_system``'s."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from dcpkit.storage.frozen import FrozenFiles
    from dcpkit.storage.writer import CrashPointWriter

    class FsspecStepWriter(CrashPointWriter, FrozenFiles, FsspecWriter):
        """Frozen files "linked" by a copy the store makes (S3's CopyObject: no byte uploaded),
        told apart by ETag and size."""

        def _object(self, folder: str, name: str) -> str:
            return self.fs.fs._strip_protocol(f"{folder}/{name}")

        def frozen_here(self) -> str:
            return str(self.final)  # uploaded straight into the step's own prefix

        def frozen_identity(self, folder: str, name: str) -> Any:
            info = self.fs.fs.info(self._object(folder, name))
            return (info.get("ETag") or info.get("etag"), info["size"])

        def frozen_link(self, folder: str, name: str) -> None:
            target = self._object(self.frozen_here(), name)
            self.fs.fs.copy(self._object(folder, name), target)
            self.fs.fs.invalidate_cache(target)

        def frozen_unlink(self, name: str) -> None:
            self.fs.fs.rm_file(self._object(self.frozen_here(), name))

    writer = FsspecStepWriter(location, sync_files=False, **storage_options)
    writer._step, writer.final = step, location
    return writer
