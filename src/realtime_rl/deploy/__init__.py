"""Deploy: lossless weight deltas, the transports that carry them, and publishing/applying them.

Public API (other stages import only these names, from `realtime_rl.deploy`):

    WeightPublisher(transport, snapshot_every=10, keep_snapshots=2, dtype=torch.bfloat16)
        .publish(tensors, version) -> PublishStats          # the trainer, after each optimizer step
        .resume() -> newest published version | None        # after a restart, before publishing again
    WeightSubscriber(transport, apply=engine.update_weights, state=None, max_chain=32)
        .poll() -> new version | None; .run(stop_event, interval_s)   # rollout workers, gateways
    FilesystemTransport(root) | HttpTransport(url) | RayTransport(name)   # where blobs travel
    weights_router(FilesystemTransport, write_token) / create_weights_app(...)   # serve a store over HTTP
    WeightState.of(tensors, version); encode_delta(base, new); encode_snapshot(state); decode(blob, base)
    DeltaError (OutOfOrder), TransportError (MissingBlob, AlreadyPublished), WeightSyncError

    Registry.open(run_dir): versions with lineage and states (candidate, canary, live, retired,
        rolled_back); register / transition / promote / rollback are atomic (expect=: StateChanged when
        someone moved the version first); DataWindow, PolicyVersion
    assign_arm(user, salt, candidate_fraction) -> "champion" | "candidate"   # the canary's stable split

The format, the codec and the measured figures: docs/weight_sync.md.
"""

from typing import Any

from realtime_rl.deploy.canary import ARMS, Arm, assign_arm, user_point
from realtime_rl.deploy.delta import (
    DeltaError, OutOfOrder, WeightState, decode, encode_delta, encode_snapshot, read_header, state_digest,
    tensor_digest,
)
from realtime_rl.deploy.registry import STATES, DataWindow, PolicyVersion, Registry, StateChanged, Transition
from realtime_rl.deploy.sync import PublishStats, WeightPublisher, WeightSubscriber, WeightSyncError
from realtime_rl.deploy.transports import (
    AlreadyPublished, FilesystemTransport, HttpTransport, MissingBlob, TransportError, WeightTransport,
    create_weights_app, weights_router,
)

__all__ = [
    "ARMS", "AlreadyPublished", "Arm", "STATES", "DataWindow", "DeltaError", "FilesystemTransport", "HttpTransport",
    "MissingBlob", "OutOfOrder", "PolicyVersion", "PublishStats", "RayTransport", "Registry", "StateChanged",
    "Transition", "TransportError", "WeightPublisher", "WeightState", "WeightSubscriber", "WeightSyncError",
    "WeightTransport", "assign_arm", "create_weights_app", "decode", "encode_delta", "encode_snapshot", "read_header",
    "state_digest", "tensor_digest", "user_point", "weights_router",
]


def __getattr__(name: str) -> Any:
    if name == "RayTransport":  # imports ray, an optional extra, only when asked for
        from realtime_rl.deploy.transports.ray import RayTransport
        return RayTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
