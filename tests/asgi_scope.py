"""The ASGI scope of a JSON POST, for tests that drive the proxy's app with their own receive/send."""

from __future__ import annotations

from typing import Any


def json_post_scope(path: str, headers: dict[str, str]) -> dict[str, Any]:
    """An HTTP/1.1 POST of `path` with a JSON content type and `headers` (names lower-cased)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")]
        + [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
