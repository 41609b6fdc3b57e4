"""Weight blobs over HTTP: a FastAPI router that serves a filesystem store, and an httpx client.

Server (mount it in the gateway or the registry, or run it alone):

    app.include_router(weights_router(FilesystemTransport("runs/weights"), write_token="s3cret"))
    # or: uvicorn.run(create_weights_app(FilesystemTransport("runs/weights")))

    GET    /weights/versions              {"versions": {"12": ["delta", "snapshot"], ...}}
    GET    /weights/{version}/{kind}      the blob; honours Range (206) so downloads resume
    PUT    /weights/{version}/{kind}      upload a blob into staging          (bearer write token)
    POST   /weights/{version}/commit      publish the staged blobs atomically (bearer write token)
    DELETE /weights/{version}             forget a version                    (bearer write token)

Without a write token the store is read-only over HTTP (writes answer 403).

Client: `HttpTransport("http://host:8000", timeout_s=30)`; every request carries the timeout (also on an
injected client, whose timeout it sets) and a
download that breaks off resumes from the bytes it has (Range) up to `max_resumes` times, within
`transfer_timeout_s` overall. Tests inject a client (a Starlette TestClient, an httpx MockTransport).
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Mapping
from typing import Annotated, Literal

import httpx
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from realtime_rl.deploy.transports.base import MissingBlob, TransportError, WeightTransport, check_blobs
from realtime_rl.deploy.transports.filesystem import SUFFIX, FilesystemTransport

Kind = Literal["delta", "snapshot"]


class VersionsPublic(BaseModel):
    versions: dict[int, list[str]]
    """Published version -> the blob kinds it holds."""


def weights_router(store: FilesystemTransport, write_token: str | None = None) -> APIRouter:
    router = APIRouter(prefix="/weights", tags=["weights"])

    def require_writer(authorization: Annotated[str | None, Header()] = None) -> None:
        if write_token is None:
            raise HTTPException(403, "this weight store is read-only over HTTP "
                                     "(the server has no write token)")
        if authorization is None or not secrets.compare_digest(authorization, f"Bearer {write_token}"):
            raise HTTPException(401, "publishing weights needs 'Authorization: Bearer <write token>'")

    writer = [Depends(require_writer)]

    def upload_dir(version: int):
        return store.root / f".upload-{version:010d}"

    @router.get("/versions")
    def versions() -> VersionsPublic:
        try:
            return VersionsPublic(versions=store.versions())
        except TransportError as exc:
            raise HTTPException(503, str(exc)) from exc

    @router.get("/{version}/{kind}")
    def blob(version: int, kind: Kind) -> FileResponse:
        path = store.blob_path(version, kind)
        if not path.is_file():
            raise HTTPException(404, f"no {kind} for version {version}")
        return FileResponse(path, media_type="application/octet-stream")

    @router.put("/{version}/{kind}", status_code=204, dependencies=writer)
    async def upload(version: int, kind: Kind, request: Request) -> None:
        if store.version_dir(version).exists():
            raise HTTPException(409, f"version {version} is already published")
        folder = upload_dir(version)
        folder.mkdir(exist_ok=True)
        with open(folder / f"{kind}{SUFFIX}.part", "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
        (folder / f"{kind}{SUFFIX}.part").rename(folder / f"{kind}{SUFFIX}")

    @router.post("/{version}/commit", status_code=201, dependencies=writer)
    def commit(version: int) -> VersionsPublic:
        folder = upload_dir(version)
        if not folder.is_dir() or not any(folder.glob(f"*{SUFFIX}")):
            raise HTTPException(400, f"nothing uploaded for version {version}: PUT its blobs first")
        for leftover in folder.glob("*.part"):
            leftover.unlink()
        if store.version_dir(version).exists():
            shutil.rmtree(folder, ignore_errors=True)
            raise HTTPException(409, f"version {version} is already published")
        try:
            store.commit(folder, version)
        except TransportError as exc:
            raise HTTPException(409, str(exc)) from exc
        return VersionsPublic(versions={version: store.versions().get(version, [])})

    @router.delete("/{version}", status_code=204, dependencies=writer)
    def delete(version: int) -> None:
        store.remove(version)

    return router


def create_weights_app(store: FilesystemTransport, write_token: str | None = None) -> FastAPI:
    app = FastAPI(title="realtime-rl weights")
    app.include_router(weights_router(store, write_token))
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
        if response.status_code >= 400:
            raise TransportError(f"{method} {url}: HTTP {response.status_code}: {_detail(response)}")
        return response

    def publish(self, version: int, blobs: Mapping[str, bytes]) -> None:
        check_blobs(version, blobs)
        for kind, data in blobs.items():
            self._request("PUT", f"/weights/{version}/{kind}", content=data, headers=self._auth)
        self._request("POST", f"/weights/{version}/commit", headers=self._auth)

    def versions(self) -> dict[int, list[str]]:
        body = self._request("GET", "/weights/versions").json()
        return {int(v): list(kinds) for v, kinds in body["versions"].items()}

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
