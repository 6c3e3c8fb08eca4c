"""The request routers living in this process, by (application, deployment): the ingress reads its
router's view for ``/cluster`` and ``/metrics``. A module of its own because Ray Serve pickles the
router's module by value (``RequestRouterConfig``): a registry there would be a copy per process
that nothing else reads. Weak references: a router Ray drops leaves on its own.
"""

from __future__ import annotations

import weakref

_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(app: str, deployment: str, router) -> None:
    _LIVE[(app, deployment)] = router


def live_router(app: str, deployment: str):
    return _LIVE.get((app, deployment))
