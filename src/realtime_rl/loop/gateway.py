"""The real-time loop's client of the gateway's admin API (traffic split between champion and canary)."""

from __future__ import annotations

from typing import Any

import httpx


class GatewayClient:
    """The loop's calls to the gateway's admin API; every call has a timeout and fails loudly."""

    def __init__(self, url: str, admin_key: str | None, timeout_s: float,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise RuntimeError(f"gateway {self.http.base_url}: {method} {path} failed: {e}") from e
        if r.status_code != 200:
            raise RuntimeError(f"gateway {self.http.base_url}: {method} {path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def traffic(self) -> dict[str, Any]:
        return self._call("GET", "/v1/admin/traffic")

    def set_candidate_fraction(self, fraction: float, salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"candidate_fraction": fraction}
        if salt is not None:
            body["salt"] = salt
        return self._call("PUT", "/v1/admin/traffic", json=body)

    def close(self) -> None:
        self.http.close()
