"""Canary and A/B traffic: which arm serves a user, by a stable hash.

    arm = assign_arm("user-42", salt="exp-7", candidate_fraction=0.05)   # "champion" or "candidate"

A user's point u is the first 8 bytes of sha256(salt + user) read as a big-endian fraction, uniform in
[0, 1); the user is in the candidate arm iff u < candidate_fraction. So:

- the same user, salt and fraction always give the same arm, in every process and on every machine
  (no Python `hash`, which is salted per process);
- raising the fraction only moves champion users to the candidate (and lowering it only moves them
  back): a ramp 1% -> 5% -> 50% never switches a candidate user back and forth;
- a new salt draws a fresh, independent split (a new experiment does not inherit the last one's users).

The gateway routes each request by its `user` (else its session id) with this function; the A/B
analysis and the sample-ratio-mismatch check compare the observed split with `candidate_fraction`.

Not here: which version each arm serves (the gateway's weight stores), or deciding to promote (evaluate).
"""

from __future__ import annotations

import hashlib
from typing import Literal

Arm = Literal["champion", "candidate"]
ARMS: tuple[Arm, Arm] = ("champion", "candidate")


def user_point(user: str, salt: str) -> float:
    """The user's uniform point in [0, 1) under `salt`."""
    digest = hashlib.sha256((salt + user).encode("utf-8")).digest()
    # the top 53 of the 64 bits: exact in a double, so the point is < 1.0 (x / 2**64 could round up to 1.0)
    return (int.from_bytes(digest[:8], "big") >> 11) * 2.0**-53


def assign_arm(user: str, salt: str, candidate_fraction: float) -> Arm:
    """"candidate" for about `candidate_fraction` of users (stable per user and salt), else "champion"."""
    if not 0.0 <= candidate_fraction <= 1.0:
        raise ValueError(f"candidate_fraction must be in [0, 1], got {candidate_fraction}")
    return "candidate" if user_point(user, salt) < candidate_fraction else "champion"
