"""Weight transports: filesystem, HTTP (router + client) and Ray's object store (base.py: the seam).

RayTransport is imported from realtime_rl.deploy.transports.ray (Ray is an optional extra)."""

from realtime_rl.deploy.transports.base import (
    KINDS, AlreadyPublished, MissingBlob, TransportError, WeightTransport,
)
from realtime_rl.deploy.transports.filesystem import FilesystemTransport
from realtime_rl.deploy.transports.http import HttpTransport, create_weights_app, weights_router

__all__ = ["KINDS", "AlreadyPublished", "FilesystemTransport", "HttpTransport", "MissingBlob", "TransportError",
           "WeightTransport", "create_weights_app", "weights_router"]
