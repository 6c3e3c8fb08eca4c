"""Every field of every route in docs/api.md's table (``server/fields.py ROUTES``, the no-ops
included) is sent by some server test that is not a generator's (``sent_fields.py``), so a field
that no test sends cannot be listed as implemented. Runs last in tests/server (its name), and only
when every server test module ran in this session (``make test``); alone, it skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.server.fields import ROUTES, route_fields
from tests.server.sent_fields import GENERATED, sent_fields

HERE = Path(__file__).resolve().parent


def test_every_documented_field_is_sent_by_a_test(request):
    ran = {Path(str(item.path)).name for item in request.session.items}
    needed = {p.name for p in HERE.glob("test_*.py")} - {g for g in GENERATED if "::" not in g} - {Path(__file__).name}
    if not needed <= ran:
        pytest.skip(f"needs every server test module in the session; missing {sorted(needed - ran)[:3]}...")
    unsent = {}
    for route, model in ROUTES.items():
        method, path = route.split(" ")
        missing = sorted(set(route_fields(model)) - sent_fields(method, path))
        if missing:
            unsent[route] = missing
    assert not unsent, f"documented fields no server test sends: {unsent}"
