"""Suite-wide collection order: the modules holding tests marked ``slow`` first, each module's tests in file order.

``make test`` runs the modules on two pytest-xdist workers, one module at a time per worker (``--dist loadfile``),
handed out in collection order; long modules handed out last would leave one worker running alone at the end.
"""

from __future__ import annotations

import os
import tempfile

# Trainings measure their kernel choice once per host and cache it (nestpipe.kernels.tuning): the suite keeps that
# cache in a directory of its own (per test process, inherited by the ranks it launches), never the user's.
os.environ.setdefault("NESTPIPE_CACHE_DIR", tempfile.mkdtemp(prefix="nestpipe-test-cache-"))


def pytest_collection_modifyitems(config, items):
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)  # stable: file order kept within
