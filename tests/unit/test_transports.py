"""Weight transports: a version appears whole or not at all, blobs come back byte-identical,
downloads resume after a broken connection, and every failure or stall ends in a clear TransportError."""

from __future__ import annotations

import builtins
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from realtime_rl.deploy import (
    AlreadyPublished, FilesystemTransport, HttpTransport, MissingBlob, TransportError, create_weights_app,
)
from realtime_rl.deploy.transports.filesystem import with_timeout

BLOBS = {"delta": b"d" * 1000 + bytes(range(256)), "snapshot": bytes(range(256)) * 300}


def exercise(transport) -> None:
    """The contract every transport keeps."""
    assert transport.versions() == {}
    transport.publish(3, BLOBS)
    transport.publish(4, {"delta": b"four"})
    assert transport.versions() == {3: ["delta", "snapshot"], 4: ["delta"]}
    assert transport.fetch(3, "snapshot") == BLOBS["snapshot"]
    assert transport.fetch(4, "delta") == b"four"
    with pytest.raises(MissingBlob):
        transport.fetch(4, "snapshot")
    with pytest.raises(MissingBlob):
        transport.fetch(99, "delta")
    with pytest.raises(AlreadyPublished, match="already published"):
        transport.publish(4, {"delta": b"again"})
    assert transport.fetch(4, "delta") == b"four"
    transport.remove(3)
    transport.remove(3)
    assert transport.versions() == {4: ["delta"]}
    with pytest.raises(ValueError):
        transport.publish(5, {"weights": b"x"})


def test_filesystem_transport(tmp_path):
    exercise(FilesystemTransport(tmp_path / "weights"))


def test_filesystem_readers_never_see_a_half_published_version(tmp_path):
    transport = FilesystemTransport(tmp_path)
    staging = transport.staging_dir()
    (staging / "delta.rtw").write_bytes(b"partial")
    assert transport.versions() == {}           # staging directories are not versions
    transport.commit(staging, 1)
    assert transport.versions() == {1: ["delta"]} and not staging.exists()
    last, seen, errors, reading = 29, [], [], threading.Event()

    def reader():  # reads every listed version until it has read the last one
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                listed = transport.versions()
                for v, kinds in listed.items():
                    seen.append((v, tuple(kinds), [transport.fetch(v, kind) == BLOBS[kind] for kind in kinds]))
                reading.set()
                if last in listed:
                    return
        except BaseException as exc:  # a listed version that cannot be read whole: failed on the test's thread
            errors.append(exc)
        finally:
            reading.set()

    t = threading.Thread(target=reader)
    t.start()
    assert reading.wait(10)
    for v in range(2, last + 1):
        transport.publish(v, BLOBS)
    t.join(30)
    assert not t.is_alive() and not errors, errors
    assert {v for v, _, _ in seen} == set(range(1, last + 1))
    assert all(kinds == ("delta", "snapshot") and all(whole) for v, kinds, whole in seen if v > 1)


def test_a_version_pruned_while_it_is_listed_is_left_out(tmp_path, monkeypatch):
    from realtime_rl.deploy.transports import filesystem

    transport = FilesystemTransport(tmp_path)
    transport.publish(1, BLOBS)
    transport.publish(2, BLOBS)
    listdir, pruned = os.listdir, []

    def pruning_listdir(path):  # the publisher prunes version 1 between the scan and its listing
        if Path(path).name.isdigit() and int(Path(path).name) == 1 and not pruned:
            pruned.append(1)
            transport.remove(1)
        return listdir(path)

    monkeypatch.setattr(filesystem.os, "listdir", pruning_listdir)
    assert transport.versions() == {2: ["delta", "snapshot"]} and pruned == [1]


def test_directories_a_killed_publish_or_remove_left_are_swept_when_old(tmp_path):
    """A kill during a publish leaves .staging-*, one during a remove .trash-*: nothing removed them, so each
    interrupted publish stranded a checkpoint-sized directory. An old one goes when a transport next opens the
    root; a recent one may be a publish still writing (another host's) and stays, as do the versions."""
    FilesystemTransport(tmp_path).publish(1, BLOBS)
    for name in (".staging-old", ".trash-0000000003-1-2", ".staging-recent"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "delta.rtw").write_bytes(b"x" * 100)
    hours_ago = time.time() - 2 * 3600
    for name in (".staging-old", ".trash-0000000003-1-2"):
        for path in (tmp_path / name / "delta.rtw", tmp_path / name):
            os.utime(path, (hours_ago, hours_ago))
    transport = FilesystemTransport(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging-recent", "0000000001"]
    assert transport.versions() == {1: ["delta", "snapshot"]}
    for path in (tmp_path / ".staging-recent" / "delta.rtw", tmp_path / ".staging-recent"):
        os.utime(path, (time.time() - 10, time.time() - 10))
    assert transport.sweep(older_than_s=5) == [".staging-recent"] and transport.fetch(1, "delta") == BLOBS["delta"]


def test_a_published_version_is_readable_by_other_users_as_the_umask_allows(tmp_path):
    """mkdtemp's 0700 staging directory became the version's mode: subscribers running as another user on the
    share could not list it, and every poll of theirs failed."""
    umask = os.umask(0o022)
    os.umask(umask)
    FilesystemTransport(tmp_path).publish(1, BLOBS)
    assert (tmp_path / "0000000001").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_failing_disk_is_a_transport_error_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """Every call finishes or raises TransportError: ENOSPC while writing and EIO while removing were raw OSErrors
    (the weights server answered 500, the publisher's prune raised after a publish that landed)."""
    transport = FilesystemTransport(tmp_path)
    transport.publish(1, BLOBS)
    real_open, real_rename = builtins.open, os.rename

    def full(path, *args, **kwargs):
        if str(path).endswith(".rtw"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(TransportError, match="publishing version 2.*No space left"):
        transport.publish(2, BLOBS)
    monkeypatch.setattr(builtins, "open", real_open)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001"]

    def failing(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(TransportError, match="removing version 1.*Input/output"):
        transport.remove(1)
    client = TestClient(create_weights_app(transport, write_token="s3cret"))
    answer = client.delete("/weights/1", headers={"Authorization": "Bearer s3cret"})
    assert answer.status_code == 503 and "Input/output" in answer.text
    monkeypatch.setattr(os, "rename", real_rename)
    assert transport.versions() == {1: ["delta", "snapshot"]}


def test_a_stalled_call_times_out_with_a_clear_error():
    with pytest.raises(TransportError, match="did not finish within 0.2 s"):
        with_timeout(lambda: time.sleep(5), 0.2, "reading a hung mount")
    with pytest.raises(KeyError):
        with_timeout(lambda: {}["x"], 1.0, "a failing call")   # errors come back to the caller


def test_calls_on_a_root_whose_earlier_calls_hang_fail_at_once_without_another_thread(tmp_path):
    """The hung threads cannot be stopped: a subscriber polling a hung share left one more behind each poll."""
    from realtime_rl.deploy.transports.filesystem import MAX_HUNG_CALLS

    mount = threading.Event()  # set: the mount answers again
    for _ in range(MAX_HUNG_CALLS):
        with pytest.raises(TransportError, match="did not finish"):
            with_timeout(lambda: mount.wait(30), 0.05, "listing", tmp_path)
    threads = threading.active_count()
    with pytest.raises(TransportError, match=f"not tried, {MAX_HUNG_CALLS} earlier calls on .* still hung"):
        with_timeout(lambda: 1, 5.0, "listing", tmp_path)
    assert threading.active_count() == threads
    assert with_timeout(lambda: 2, 5.0, "listing", tmp_path / "other") == 2  # another root is not held up
    mount.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the hung calls finish, and with them the refusal
        try:
            assert with_timeout(lambda: 3, 5.0, "listing", tmp_path) == 3
            break
        except TransportError:
            time.sleep(0.01)
    else:
        pytest.fail("calls on the root were still refused after the hung ones finished")


# ------------------------------------------------------------------------------------------------ http

@pytest.fixture
def http_store(tmp_path):
    store = FilesystemTransport(tmp_path)
    client = TestClient(create_weights_app(store, write_token="s3cret"))
    return store, client


def test_http_transport(http_store):
    _, client = http_store
    exercise(HttpTransport(client=client, token="s3cret", timeout_s=5))


def test_http_serves_ranges_and_answers_bad_input_with_4xx(http_store):
    store, client = http_store
    store.publish(7, BLOBS)
    size = len(BLOBS["snapshot"])
    r = client.get("/weights/7/snapshot", headers={"Range": "bytes=100-"})
    assert r.status_code == 206 and r.content == BLOBS["snapshot"][100:]
    assert r.headers["content-range"] == f"bytes 100-{size - 1}/{size}"
    r = client.get("/weights/7/snapshot", headers={"Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == BLOBS["snapshot"][100:200]
    assert client.get("/weights/7/snapshot").content == BLOBS["snapshot"]
    assert client.get("/weights/7/snapshot", headers={"Range": f"bytes={size}-"}).status_code == 416
    assert client.get("/weights/7/model").status_code == 422
    assert client.get("/weights/8/delta").status_code == 404
    upload = {"upload": "0" * 32}
    assert client.put("/weights/9/delta", params=upload, content=b"x").status_code == 401
    wrong, writer = {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret"}
    assert client.put("/weights/9/delta", params=upload, content=b"x", headers=wrong).status_code == 401
    assert client.put("/weights/9/delta", params={"upload": "../../x"}, content=b"x", headers=writer).status_code == 422
    r = client.post("/weights/9/commit", json={**upload, "kinds": ["delta"]}, headers=writer)
    assert r.status_code == 400 and "PUT them first" in r.json()["detail"]
    readonly = TestClient(create_weights_app(store))
    r = readonly.put("/weights/9/delta", params=upload, content=b"x")
    assert r.status_code == 403 and "read-only" in r.json()["detail"]
    with pytest.raises(TransportError, match="HTTP 401"):
        HttpTransport(client=client, token="wrong").publish(9, {"delta": b"x"})


def test_http_refuses_versions_outside_the_store_and_blobs_past_the_cap(tmp_path, monkeypatch):
    """Version -5 was stored as '-000000005' (never listed, so never pruned), 10**400 was a 500; a blob had
    no size limit. An upload is fsynced before it is renamed (a power cut after the commit left empty blobs)."""
    store = FilesystemTransport(tmp_path)
    client = TestClient(create_weights_app(store, write_token="s3cret", max_blob_bytes=1000))
    writer, upload = {"Authorization": "Bearer s3cret"}, {"upload": "0" * 32}
    for version in ("-5", str(10**400), str(10**10)):
        assert client.put(f"/weights/{version}/delta", params=upload, content=b"x", headers=writer).status_code == 422
        assert client.get(f"/weights/{version}/delta").status_code == 422
        assert client.post(f"/weights/{version}/commit", json={**upload, "kinds": ["delta"]},
                           headers=writer).status_code == 422
    r = client.put("/weights/3/snapshot", params=upload, content=b"x" * 1001, headers=writer)
    assert r.status_code == 413 and "max_blob_bytes" in r.json()["detail"]
    assert not list(tmp_path.glob(".upload-*/*"))  # no half blob stays behind
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    assert client.put("/weights/3/delta", params=upload, content=b"x" * 1000, headers=writer).status_code == 204
    assert any(path.endswith("delta.rtw.part") for path in synced), synced
    r = client.post("/weights/3/commit", json={**upload, "kinds": ["delta"]}, headers=writer)
    assert r.status_code == 201 and store.fetch(3, "delta") == b"x" * 1000


def test_http_publish_commits_only_the_blobs_it_uploaded(http_store, tmp_path):
    """A publisher that died between its uploads and its commit left blobs in staging: a retry of the version
    publishes exactly what it sent, never the aborted attempt's snapshot of other weights."""
    store, client = http_store
    writer, aborted = {"Authorization": "Bearer s3cret"}, {"upload": "0" * 32}
    for kind in ("delta", "snapshot"):
        r = client.put(f"/weights/5/{kind}", params=aborted, content=b"stale " + kind.encode(), headers=writer)
        assert r.status_code == 204
    HttpTransport(client=client, token="s3cret").publish(5, {"delta": b"fresh delta"})
    assert store.versions() == {5: ["delta"]} and store.fetch(5, "delta") == b"fresh delta"
    assert not list(tmp_path.glob(".upload-*"))   # the aborted attempt's staging went with the commit
    client.put("/weights/6/delta", params=aborted, content=b"x", headers=writer)
    r = client.post("/weights/6/commit", json={**aborted, "kinds": ["delta", "snapshot"]}, headers=writer)
    assert r.status_code == 400 and "snapshot" in r.json()["detail"] and 6 not in store.versions()


def test_staging_of_abandoned_publishes_is_removed_after_its_ttl(tmp_path):
    """A publisher that died before its commit, or never published that version again, left staging that no
    commit of its version will drop: an upload or commit removes what was not written to for upload_ttl_s."""
    store = FilesystemTransport(tmp_path)
    client = TestClient(create_weights_app(store, write_token="s3cret", upload_ttl_s=600))
    writer = {"Authorization": "Bearer s3cret"}
    for version, upload in ((3, "a" * 32), (4, "b" * 32)):
        r = client.put(f"/weights/{version}/delta", params={"upload": upload}, content=b"x", headers=writer)
        assert r.status_code == 204
    abandoned, recent = tmp_path / f".upload-{3:010d}-{'a' * 32}", tmp_path / f".upload-{4:010d}-{'b' * 32}"
    hour_ago = time.time() - 3600
    for path in (abandoned, *abandoned.iterdir()):
        os.utime(path, (hour_ago, hour_ago))
    HttpTransport(client=client, token="s3cret").publish(7, {"delta": b"d"})
    assert not abandoned.exists() and recent.is_dir()   # the other attempt may still commit
    assert store.versions() == {7: ["delta"]}
    r = client.post("/weights/4/commit", json={"upload": "b" * 32, "kinds": ["delta"]}, headers=writer)
    assert r.status_code == 201 and store.versions() == {4: ["delta"], 7: ["delta"]}


def test_a_blob_pruned_as_it_is_served_is_a_404_or_comes_whole(tmp_path, monkeypatch):
    """The publisher prunes old versions while subscribers download them: a blob gone when the server opens it
    is a 404 (MissingBlob), one pruned after that still arrives whole; never a 500 or a body cut short."""
    store = FilesystemTransport(tmp_path)
    store.publish(3, BLOBS)
    store.publish(4, BLOBS)
    real_open = builtins.open

    def pruning_open(file, *args, **kwargs):  # version 3 is pruned just before its blob is opened, 4 just after
        folder = Path(file).parent if isinstance(file, (str, os.PathLike)) else None
        if folder == store.version_dir(3):
            store.remove(3)
        f = real_open(file, *args, **kwargs)
        if folder == store.version_dir(4):
            store.remove(4)
        return f

    monkeypatch.setattr(builtins, "open", pruning_open)
    client = TestClient(create_weights_app(store), raise_server_exceptions=False)
    r = client.get("/weights/3/snapshot")
    assert r.status_code == 404 and "no snapshot for version 3" in r.json()["detail"]
    r = client.get("/weights/4/snapshot")
    assert r.status_code == 200 and r.content == BLOBS["snapshot"] and store.versions() == {}
    store.publish(3, BLOBS)
    with pytest.raises(MissingBlob):
        HttpTransport(client=client).fetch(3, "delta")


class BreakingStream(httpx.SyncByteStream):
    """Sends `cut` bytes of the body, then fails like a dropped connection."""

    def __init__(self, body: bytes, cut: int) -> None:
        self.body, self.cut = body, cut

    def __iter__(self):
        yield self.body[: self.cut]
        raise httpx.ReadError("connection reset by peer")


def test_http_download_resumes_after_a_broken_connection():
    body = bytes(range(256)) * 4000
    ranges = []

    def handler(request: httpx.Request) -> httpx.Response:
        start = int(request.headers.get("range", "bytes=0-")[6:-1])
        ranges.append(start)
        rest = body[start:]
        headers = {"content-range": f"bytes {start}-{len(body) - 1}/{len(body)}"} if start else {}
        cut = len(rest) if len(ranges) >= 3 else len(rest) // 3
        return httpx.Response(206 if start else 200, headers={**headers, "content-length": str(len(rest))},
                              stream=BreakingStream(rest, cut) if cut < len(rest) else httpx.ByteStream(rest))

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://weights")
    assert HttpTransport(client=client).fetch(1, "snapshot") == body
    assert ranges[0] == 0 and 0 < ranges[1] < ranges[2] < len(body)


def test_http_gives_up_with_a_clear_error_when_the_server_keeps_failing():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadTimeout("timed out", request=request)

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://weights")
    transport = HttpTransport(client=client, timeout_s=0.1, max_resumes=2)
    with pytest.raises(TransportError, match="gave up after 3 broken transfers.*ReadTimeout"):
        transport.fetch(1, "delta")
    assert len(calls) == 3
    with pytest.raises(TransportError, match="ReadTimeout"):
        transport.versions()


@pytest.mark.parametrize("answer", [httpx.Response(200, text="<html>proxy login</html>"),
                                    httpx.Response(200, json={"kinds": []}),
                                    httpx.Response(200, json={"versions": {"three": ["delta"]}})])
def test_a_listing_that_is_not_one_is_a_transport_error(answer):
    client = httpx.Client(transport=httpx.MockTransport(lambda request: answer), base_url="http://weights")
    with pytest.raises(TransportError, match="not a version listing"):
        HttpTransport(client=client).versions()


def test_a_store_directory_that_went_away_is_a_transport_error(tmp_path):
    transport = FilesystemTransport(tmp_path / "store")
    transport.publish(1, {"delta": b"one"})
    (tmp_path / "store").rename(tmp_path / "moved")  # removed or unmounted under a follower
    with pytest.raises(TransportError, match="listing"):
        transport.versions()


def test_http_requests_carry_the_timeout():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(200, json={"versions": {}})

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://weights")
    HttpTransport(client=client, timeout_s=2.5).versions()
    assert seen[0]["read"] == 2.5 and seen[0]["connect"] == 2.5


# ------------------------------------------------------------------------------------------------- ray

def test_ray_transport():
    ray = pytest.importorskip("ray", reason="ray is an optional extra")
    from realtime_rl.deploy import RayTransport

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        transport = RayTransport(name="test-weights", timeout_s=30)
        exercise(transport)
        again = RayTransport(name="test-weights", timeout_s=30)   # another handle finds the same store
        assert again.versions() == {4: ["delta"]} and again.fetch(4, "delta") == b"four"
        transport.close()
        with pytest.raises(TransportError):
            again.versions()
    finally:
        if started:
            ray.shutdown()
