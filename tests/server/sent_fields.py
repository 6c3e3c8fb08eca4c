"""What the server tests send: every JSON request body any ``httpx`` / ``httpx2`` client (the
official ``openai`` client, plain ``httpx``, starlette's ``TestClient``) sends while a server test
runs, so that ``test_zz_every_field_is_sent.py`` can check every field of docs/api.md's table is
sent by some test. Tests whose bodies come from a generator (hypothesis, schemathesis) are not
counted: they reach fields by chance, not by a test that checks what the field does."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# the tests (files, or name prefixes within one) whose bodies a generator makes
GENERATED = ("test_hostile.py", "test_openapi_fuzz.py", "test_errors.py::test_random_")


@dataclass(frozen=True)
class Sent:
    method: str
    path: str
    body: object
    test: str


SENT: list[Sent] = []


def record(request) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    if any(name in test for name in GENERATED):
        return
    try:
        body = json.loads(request.content)
    except Exception:  # noqa: BLE001 - a streamed, empty or non-JSON body: nothing to count
        return
    SENT.append(Sent(request.method, request.url.path, body, test))


@contextmanager
def recording() -> Iterator[None]:
    """Every ``send`` of httpx's and httpx2's clients records its request first."""
    import httpx
    import httpx2

    patched = []
    for cls in (httpx.Client, httpx.AsyncClient, httpx2.Client, httpx2.AsyncClient):
        original = cls.send

        def send(self, request, *args, _original=original, **kwargs):
            record(request)
            return _original(self, request, *args, **kwargs)  # AsyncClient's: the coroutine, awaited by its caller

        cls.send = send
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.send = original


def field_paths(value, prefix: str = "") -> set[str]:
    """A body's fields named as ``server/fields.py route_fields`` names them: ``a.b``, ``a[].b``
    (list items), ``a[][].b`` (lists of lists)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            out.add(prefix + str(key))
            out |= field_paths(inner, f"{prefix}{key}.")
    elif isinstance(value, list):
        item_prefix = prefix[:-1] + "[]." if prefix.endswith(".") else prefix
        for inner in value:
            out |= field_paths(inner, item_prefix)
    return out


def on_route(path: str, route_path: str) -> bool:
    """``path`` is ``route_path``, or it behind a one-segment prefix (``--root-path /llm``)."""
    if path == route_path:
        return True
    head = path[: -len(route_path)] if path.endswith(route_path) else ""
    return head.count("/") == 1 and head.startswith("/")


def sent_fields(method: str, route_path: str) -> set[str]:
    return {f for s in SENT if s.method == method and on_route(s.path, route_path) for f in field_paths(s.body)}
