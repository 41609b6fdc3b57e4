"""Weight blobs in Ray's object store, indexed by a named actor.

    ray.init(num_cpus=2)
    transport = RayTransport(name="weights")          # any process in the cluster opens the same one

`publish` hands the blobs to the directory actor, which puts each into the object store itself (so
the actor owns them and they outlive the publishing process) under the version; `fetch` asks the
actor for the reference and reads the object straight from the object store. Every actor call and
every object read
waits at most `timeout_s` and otherwise raises TransportError. Removing a version drops the
actor's references and Ray frees the objects.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import ray
from ray.exceptions import GetTimeoutError, RayError

from realtime_rl.deploy.transports.base import (
    AlreadyPublished, MissingBlob, TransportError, WeightTransport, check_blobs,
)


@ray.remote(num_cpus=0)
class _Directory:
    """version -> {kind: ObjectRef} of objects this actor owns; refs travel inside lists so Ray does not
    resolve them on the way out."""

    def __init__(self) -> None:
        self._refs: dict[int, dict[str, ray.ObjectRef]] = {}

    def add(self, version: int, blobs: dict[str, bytes]) -> bool:
        if version in self._refs:
            return False
        self._refs[version] = {kind: ray.put(data) for kind, data in blobs.items()}
        return True

    def versions(self) -> dict[int, list[str]]:
        return {v: sorted(refs) for v, refs in self._refs.items()}

    def ref(self, version: int, kind: str) -> list[ray.ObjectRef] | None:
        ref = self._refs.get(version, {}).get(kind)
        return None if ref is None else [ref]

    def remove(self, version: int) -> None:
        self._refs.pop(version, None)


class RayTransport(WeightTransport):
    def __init__(self, name: str = "realtime_rl_weights", namespace: str | None = None,
                 timeout_s: float = 60.0, detached: bool = False) -> None:
        """The directory actor lives while the handle that created it does, or, `detached`, until
        `close()`: a detached store outlives a publisher that crashes and restarts."""
        if not ray.is_initialized():
            raise ValueError("RayTransport needs a running Ray: call ray.init() first")
        self.timeout_s = timeout_s
        self.name = name
        options = {"name": name, "namespace": namespace, "get_if_exists": True}
        if detached:
            options["lifetime"] = "detached"
        self._directory = _Directory.options(**options).remote()

    def close(self) -> None:
        """Stop the directory actor (every blob it holds is freed); returns once it is gone, so no
        handle to it answers after close (ray.kill itself is asynchronous)."""
        ray.kill(self._directory)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(self._directory.versions.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                break
            except RayError:  # the actor is dead
                return
            time.sleep(0.01)
        raise TransportError(f"the weight directory actor did not stop within {self.timeout_s:g} s")

    def _get(self, ref: ray.ObjectRef, what: str):
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as exc:
            raise TransportError(f"{what}: no answer within {self.timeout_s:g} s") from exc
        except RayError as exc:
            raise TransportError(f"{what}: {type(exc).__name__}: {exc}") from exc

    def publish(self, version: int, blobs: Mapping[str, bytes]) -> None:
        check_blobs(version, blobs)
        if not self._get(self._directory.add.remote(version, dict(blobs)), f"publishing version {version}"):
            raise AlreadyPublished(f"version {version} is already published in Ray directory {self.name!r}")

    def versions(self) -> dict[int, list[str]]:
        return self._get(self._directory.versions.remote(), f"listing Ray directory {self.name!r}")

    def fetch(self, version: int, kind: str) -> bytes:
        what = f"fetching the {kind} of version {version} from Ray"
        found = self._get(self._directory.ref.remote(version, kind), what)
        if found is None:
            raise MissingBlob(f"no {kind} for version {version} in Ray directory {self.name!r}")
        return self._get(found[0], what)

    def remove(self, version: int) -> None:
        self._get(self._directory.remove.remote(version), f"removing version {version} from Ray")
