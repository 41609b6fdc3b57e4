"""The weight transport seam: where a publisher puts versioned blobs and subscribers find them.

A version is published once, atomically, as a few named blobs: "delta" (from the previous published
version) and/or "snapshot" (the full weights). Readers never see a half-published version. Every
call finishes or raises TransportError within the transport's timeout; nothing waits forever.

A publish that raised TransportError may have landed anyway, then or later: the transfer can outlive
the timeout that gave up on it (a filesystem writer thread, an HTTP commit whose answer was lost). So
a publisher must not build on the version before it as if the failed one were absent (WeightPublisher
makes its next publish carry a snapshot), and a retry may meet AlreadyPublished.

Implementations: filesystem.py (a directory per version, made visible by one rename), http.py (a
FastAPI router that serves a filesystem store, and a client with resumable downloads), ray.py (Ray's
object store, indexed by a named actor).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

KINDS = ("delta", "snapshot")


class TransportError(RuntimeError):
    """A transfer failed or timed out; the message says which version, which blob and why."""


class MissingBlob(TransportError):
    """The version or blob does not exist (never published, or pruned)."""


class AlreadyPublished(TransportError):
    """The version exists already; on a retry, the attempt that raised landed after all."""


def check_blobs(version: int, blobs: Mapping[str, bytes]) -> None:
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if not blobs or set(blobs) - set(KINDS):
        raise ValueError(f"publish needs blobs named {KINDS}, got {sorted(blobs)}")


class WeightTransport(ABC):
    timeout_s: float
    """Upper bound on any single call (per request where a call makes several)."""

    @abstractmethod
    def publish(self, version: int, blobs: Mapping[str, bytes]) -> None:
        """Make `blobs` visible under `version`, all at once; AlreadyPublished if it already exists.
        Any other TransportError leaves it unknown whether the version landed (see the module docstring)."""

    @abstractmethod
    def versions(self) -> dict[int, list[str]]:
        """Every published version and the blob kinds it holds."""

    @abstractmethod
    def fetch(self, version: int, kind: str) -> bytes:
        """One blob; MissingBlob if it is not there, TransportError if the transfer fails."""

    @abstractmethod
    def remove(self, version: int) -> None:
        """Forget a version (no error if it is already gone)."""
