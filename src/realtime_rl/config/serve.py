"""`rtrl serve`: the gateway's config and its API keys."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from realtime_rl.config.base import StrictModel


class ApiKey(StrictModel):
    """One bearer key and what it may do."""

    name: str = Field(min_length=1, max_length=64)
    """Who holds the key (shown in logs and metrics, never the key itself)."""
    key: str = Field(min_length=16, max_length=256)
    """The secret; clients send `Authorization: Bearer <key>`."""
    scopes: list[Literal["inference", "feedback", "admin"]] = Field(min_length=1)
    """inference: completions and models; feedback: POST /v1/feedback; admin: registry and weights."""


class ServeConfig(StrictModel):
    """`rtrl serve`: the OpenAI-compatible gateway in front of the engine."""

    checkpoint: Path | None = None
    """The Hugging Face checkpoint directory to serve (with its tokenizer)."""
    model_name: str = Field("rtrl-policy", min_length=1, max_length=128)
    """The model id clients name in requests and see in GET /v1/models."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to bind (0 picks a free one)."""
    run_dir: Path = Path("runs/serve")
    """Where the SQLite event store (events.sqlite) lives."""
    store: str = Field("sqlite", min_length=1, max_length=4096)
    """The event store: "sqlite" (run_dir/events.sqlite, the default) or a Postgres URL such as
    postgresql://127.0.0.1:5432/test (add ?options=-csearch_path%3Dname to use an existing schema)."""
    api_keys: list[ApiKey] = Field(default_factory=list)
    """Bearer keys with scopes; requests without a valid key get 401, with a key lacking the scope 403."""
    allow_unauthenticated: bool = False
    """Serve without keys (local experiments only); refused when api_keys is non-empty."""
    max_batch: int = Field(32, ge=1, le=4096)
    """Sequences decoded together (KV-cache slots)."""
    max_seq_len: int = Field(2048, ge=16, le=4_194_304)
    """Longest prompt + completion; longer prompts get a 400."""
    max_pending: int = Field(256, ge=1, le=1_000_000)
    """Requests queued or running before new ones get 503 (backpressure)."""
    compile_decode: bool = False
    """Run the engine's decode step through torch.compile (engine/engine.py), compiled before the gateway
    serves (~10 s with inductor's on-disk cache, ~1 min without): 1.1-2.5x the eager decode tokens/s on
    CPU at short contexts, more at small batches (`rtrl bench engine`), none at thousands of tokens."""
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    """A completion that takes longer is aborted and answered 504."""
    default_max_tokens: int = Field(256, ge=1, le=1_000_000)
    """max_tokens when a request does not give one."""
    max_request_bytes: int = Field(8 * 2**20, ge=1024, le=2**30)
    """Largest request body; a larger one is answered 413 before it is parsed (or tokenized)."""
    device: str = "cpu"
    """Torch device for the engine (cpu, cuda, cuda:1)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights dtype; None keeps the checkpoint's."""
    weights: str | None = None
    """A weight store to follow (a directory of the filesystem transport, or the http(s) URL of a weights
    server): each newly published version arrives as a verified lossless delta and is hot-swapped in."""
    weights_poll_s: float = Field(2.0, gt=0, le=3600)
    """How often the gateway checks the weight stores for a new version."""
    candidate_weights: str | None = None
    """The weight store the candidate arm follows (a directory or an http(s) URL, as for `weights`). The
    arm exists once the store has a version: an engine of the champion's architecture and tokenizer with
    the weights the store rebuilds, hot-swapping later versions as the champion does."""
    candidate_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of users the candidate arm serves once it exists (a stable hash of the user and traffic_salt;
    deploy.canary). PUT /v1/admin/traffic changes it at run time and writes run_dir/traffic.json, which
    then wins over this value when the gateway restarts."""
    traffic_salt: str = Field("rtrl", min_length=1, max_length=128)
    """Salt of the user hash: a new salt draws a new, independent split of users."""

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if v == "sqlite":
            return v
        example = "postgresql://127.0.0.1:5432/test"
        try:
            url = urllib.parse.urlsplit(v)
            url.port  # noqa: B018 (parses the port: a bad one raises ValueError)
        except ValueError as e:
            raise ValueError(f'store: not a valid URL ({e}); give "sqlite" or a URL like {example}') from None
        if url.scheme not in ("postgresql", "postgres"):
            raise ValueError(f'store must be "sqlite" or a postgresql:// URL like {example}; got scheme '
                             f"{url.scheme or 'none'!r}")
        if not url.hostname and "host=" not in url.query:
            raise ValueError(f"store: the Postgres URL names no host; give one, like {example}")
        if url.path.strip("/") == "" and "dbname=" not in url.query:
            raise ValueError(f"store: the Postgres URL names no database; give one, like {example}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.allow_unauthenticated and self.api_keys:
            raise ValueError("allow_unauthenticated cannot be combined with api_keys")
        names = [k.name for k in self.api_keys]
        if len(set(names)) != len(names):
            raise ValueError("api_keys names must be unique")
        if self.candidate_weights is not None and self.candidate_weights == self.weights:
            raise ValueError("candidate_weights must name another weight store than weights (the champion's)")
        return self
