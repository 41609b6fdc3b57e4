"""Weight blobs over HTTP: a FastAPI router that serves a filesystem store, and an httpx client.

Server (mount it in the gateway or the registry, or run it alone):

    app.include_router(weights_router(FilesystemTransport("runs/weights"), write_token="s3cret"))
    # or: uvicorn.run(create_weights_app(FilesystemTransport("runs/weights")))

    GET    /weights/versions                    {"versions": {"12": ["delta", "snapshot"], ...}}
    GET    /weights/{version}/{kind}            the blob; honours `Range: bytes=a-[b]` (206): downloads resume
    PUT    /weights/{version}/{kind}?upload=ID  upload a blob into that upload's staging (bearer write token)
    POST   /weights/{version}/commit            {"upload": ID, "kinds": [...]}: publish exactly those blobs
                                                of that upload, atomically              (bearer write token)
    DELETE /weights/{version}                   forget a version                        (bearer write token)

Without a write token the store is read-only over HTTP (writes answer 403). Each publish uploads under a
fresh ID, so blobs that an aborted attempt left in staging are never committed with a later one; the
commit deletes every staging folder of its version, and each upload or commit deletes any staging folder
untouched for `upload_ttl_s` (attempts whose publisher died or never published that version again). A version
that exists answers 409.

Client: `HttpTransport("http://host:8000", timeout_s=30)`; every request carries the timeout (also on an
injected client, whose timeout it sets) and a
download that breaks off resumes from the bytes it has (Range) up to `max_resumes` times, within
`transfer_timeout_s` overall. Tests inject a client (a Starlette TestClient, an httpx MockTransport).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

import httpx
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from realtime_rl.deploy.transports.base import (
    AlreadyPublished, MissingBlob, TransportError, WeightTransport, check_blobs,
)
from realtime_rl.deploy.transports.filesystem import SUFFIX, FilesystemTransport, remove_abandoned

Kind = Literal["delta", "snapshot"]
UPLOAD_ID = r"^[0-9a-f]{16,64}$"
UploadId = Annotated[str, Query(pattern=UPLOAD_ID, description="one publish attempt's staging (hex)")]
Version = Annotated[int, PathParam(ge=0, lt=10**10, description="a store version (its directory: 10 digits)")]
MAX_BLOB_BYTES = 64 << 30
"""The largest blob a PUT takes (413 past it): a snapshot of a model bigger than ~30B parameters in bf16 needs
more (weights_router's max_blob_bytes)."""


class VersionsPublic(BaseModel):
    versions: dict[int, list[str]]
    """Published version -> the blob kinds it holds."""


class CommitCreate(BaseModel):
    upload: str = Field(pattern=UPLOAD_ID)
    """The ID the blobs were PUT under: one per publish attempt."""
    kinds: list[Kind] = Field(min_length=1)
    """The blobs that make up the version; each must have been uploaded, and only these are published."""


UPLOAD_TTL_S = 3600.0
"""A staging folder nothing was written to for this long belongs to an abandoned publish attempt."""


def weights_router(store: FilesystemTransport, write_token: str | None = None,
                   upload_ttl_s: float = UPLOAD_TTL_S, max_blob_bytes: int = MAX_BLOB_BYTES) -> APIRouter:
    router = APIRouter(prefix="/weights", tags=["weights"])

    def require_writer(authorization: Annotated[str | None, Header()] = None) -> None:
        if write_token is None:
            raise HTTPException(403, "this weight store is read-only over HTTP "
                                     "(the server has no write token)")
        if authorization is None or not secrets.compare_digest(authorization, f"Bearer {write_token}"):
            raise HTTPException(401, "publishing weights needs 'Authorization: Bearer <write token>'")

    writer = [Depends(require_writer)]

    def upload_dir(version: int, upload: str):
        return store.root / f".upload-{version:010d}-{upload}"

    def drop_uploads(version: int) -> None:
        for folder in store.root.glob(f".upload-{version:010d}-*"):
            shutil.rmtree(folder, ignore_errors=True)

    def drop_abandoned_uploads(keep: Path) -> None:
        remove_abandoned(store.root, (".upload-",), upload_ttl_s, keep)

    @router.get("/versions")
    def versions() -> VersionsPublic:
        try:
            return VersionsPublic(versions=store.versions())
        except TransportError as exc:
            raise HTTPException(503, str(exc)) from exc

    @router.get("/{version}/{kind}")
    def blob(version: Version, kind: Kind,
             range_: Annotated[str | None, Header(alias="range")] = None) -> StreamingResponse:
        # Served from a handle opened before answering: a version pruned after this still reads whole, and
        # one pruned before is a 404 (FileResponse opens the path only after sending its 200).
        try:
            f = open(store.blob_path(version, kind), "rb")
        except FileNotFoundError:
            raise HTTPException(404, f"no {kind} for version {version}") from None
        size = os.fstat(f.fileno()).st_size
        start, end, status, headers = 0, size, 200, {"accept-ranges": "bytes"}
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", range_ or "")
        if wanted:  # the form HttpTransport resumes with; HTTP lets a server answer any other with the whole blob
            start, status = int(wanted[1]), 206
            end = min(size, int(wanted[2]) + 1) if wanted[2] else size
            if start >= end:
                f.close()
                raise HTTPException(416, f"range {range_} is outside {size} bytes",
                                    headers={"content-range": f"bytes */{size}"})
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        headers["content-length"] = str(end - start)
        return StreamingResponse(read_span(f, start, end), status, headers, media_type="application/octet-stream")

    @router.put("/{version}/{kind}", status_code=204, dependencies=writer)
    async def upload(version: Version, kind: Kind, upload: UploadId, request: Request) -> None:
        # The file work runs in threads: a mounted router must not stall its app's event loop on a slow disk.
        folder = upload_dir(version, upload)
        part, blob = folder / f"{kind}{SUFFIX}.part", folder / f"{kind}{SUFFIX}"

        def open_part() -> BinaryIO:
            if store.version_dir(version).exists():
                raise HTTPException(409, f"version {version} is already published")
            drop_abandoned_uploads(keep=folder)
            folder.mkdir(exist_ok=True)
            return open(part, "wb")

        def finish(f: BinaryIO) -> None:  # durable before the commit names it (a power cut left empty blobs)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            part.rename(blob)

        f = await run_in_threadpool(open_part)
        try:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_blob_bytes:
                    raise HTTPException(413, f"a blob is at most {max_blob_bytes} bytes here (max_blob_bytes)")
                await run_in_threadpool(f.write, chunk)
            await run_in_threadpool(finish, f)
        finally:
            if not f.closed:  # refused or broken off: no half blob stays behind
                f.close()
                part.unlink(missing_ok=True)

    @router.post("/{version}/commit", status_code=201, dependencies=writer)
    def commit(version: Version, body: CommitCreate) -> VersionsPublic:
        if store.version_dir(version).exists():
            drop_uploads(version)
            raise HTTPException(409, f"version {version} is already published")
        folder = upload_dir(version, body.upload)
        drop_abandoned_uploads(keep=folder)
        named = {f"{kind}{SUFFIX}" for kind in body.kinds}
        missing = sorted(named - {p.name for p in folder.glob(f"*{SUFFIX}")})
        if missing:
            raise HTTPException(400, f"upload {body.upload} of version {version} lacks {missing}: PUT them first")
        for path in folder.iterdir():
            if path.name not in named:  # a broken-off .part, or a blob this commit does not name
                path.unlink()
        try:
            store.commit(folder, version)
        except AlreadyPublished as exc:
            raise HTTPException(409, str(exc)) from exc
        except TransportError as exc:
            raise HTTPException(503, str(exc)) from exc
        finally:
            drop_uploads(version)
        return VersionsPublic(versions={version: store.versions().get(version, [])})

    @router.delete("/{version}", status_code=204, dependencies=writer)
    def delete(version: Version) -> None:
        try:
            store.remove(version)
        except TransportError as exc:
            raise HTTPException(503, str(exc)) from exc

    return router


def read_span(f: BinaryIO, start: int, end: int, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Bytes [start, end) of an open file, in chunks; closes it."""
    with f:
        f.seek(start)
        while start < end:
            chunk = f.read(min(chunk_size, end - start))
            if not chunk:
                return
            start += len(chunk)
            yield chunk


def create_weights_app(store: FilesystemTransport, write_token: str | None = None,
                       upload_ttl_s: float = UPLOAD_TTL_S, max_blob_bytes: int = MAX_BLOB_BYTES) -> FastAPI:
    app = FastAPI(title="realtime-rl weights")
    app.include_router(weights_router(store, write_token, upload_ttl_s, max_blob_bytes))
    return app


class HttpTransport(WeightTransport):
    def __init__(self, base_url: str = "", timeout_s: float = 30.0, token: str | None = None, *,
                 client: httpx.Client | None = None, max_resumes: int = 5,
                 transfer_timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.max_resumes = max_resumes
        self.transfer_timeout_s = transfer_timeout_s
        self._client = client if client is not None else httpx.Client(base_url=base_url)
        self._client.timeout = httpx.Timeout(timeout_s)  # every request, injected clients too
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, url: str, **kwargs) -> httpx.Response:
        try:
            response = self._client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise TransportError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            raise MissingBlob(f"{method} {url}: {_detail(response)}")
        if response.status_code == 409:
            raise AlreadyPublished(f"{method} {url}: {_detail(response)}")
        if response.status_code >= 400:
            raise TransportError(f"{method} {url}: HTTP {response.status_code}: {_detail(response)}")
        return response

    def publish(self, version: int, blobs: Mapping[str, bytes]) -> None:
        check_blobs(version, blobs)
        upload = secrets.token_hex(16)  # this attempt's own staging: nothing an aborted attempt left is committed
        for kind, data in blobs.items():
            self._request("PUT", f"/weights/{version}/{kind}", params={"upload": upload}, content=data,
                          headers=self._auth)
        commit = CommitCreate(upload=upload, kinds=list(blobs))
        self._request("POST", f"/weights/{version}/commit", json=commit.model_dump(), headers=self._auth)

    def versions(self) -> dict[int, list[str]]:
        response = self._request("GET", "/weights/versions")
        try:  # a 200 that is not the listing (a proxy's HTML page, say) is a transport fault, not a crash
            return {int(v): list(kinds) for v, kinds in response.json()["versions"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TransportError(f"GET {response.url}: not a version listing "
                                 f"({type(exc).__name__}: {exc}): {response.text[:200]!r}") from exc

    def remove(self, version: int) -> None:
        self._request("DELETE", f"/weights/{version}", headers=self._auth)

    def fetch(self, version: int, kind: str) -> bytes:
        """Download a blob, resuming with Range after a broken connection."""
        url = f"/weights/{version}/{kind}"
        deadline = time.monotonic() + self.transfer_timeout_s
        data, total, failures = bytearray(), None, 0
        while True:
            headers = {"Range": f"bytes={len(data)}-"} if data else {}
            try:
                with self._client.stream("GET", url, headers=headers) as response:
                    if response.status_code == 404:
                        raise MissingBlob(f"GET {url}: {_detail(response, read=True)}")
                    if response.status_code not in (200, 206):
                        raise TransportError(f"GET {url}: HTTP {response.status_code}: "
                                             f"{_detail(response, read=True)}")
                    if response.status_code == 200:  # a full body: start over (the server ignored Range)
                        data.clear()
                        total = int(response.headers.get("content-length", -1))
                    else:
                        total = int(response.headers["content-range"].rsplit("/", 1)[1])
                    for chunk in response.iter_bytes():
                        data += chunk
                        if time.monotonic() > deadline:
                            raise TransportError(f"GET {url}: not done after {self.transfer_timeout_s:g} s "
                                                 f"({len(data)} of {total} bytes)")
                if total in (None, -1) or len(data) == total:
                    return bytes(data)
                failure = f"connection ended at {len(data)} of {total} bytes"
            except httpx.TransportError as exc:  # network errors and timeouts: resume
                failure = f"{type(exc).__name__}: {exc}"
            failures += 1
            if failures > self.max_resumes or time.monotonic() > deadline:
                raise TransportError(f"GET {url}: gave up after {failures} broken transfers "
                                     f"({len(data)} bytes received); last: {failure}")


def _detail(response: httpx.Response, read: bool = False) -> str:
    if read:
        response.read()
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text[:200]
