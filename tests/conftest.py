"""Suite-wide collection order: the modules holding tests marked ``slow`` first, each module's tests in file order.

``make test`` runs the modules on two pytest-xdist workers, one module at a time per worker (``--dist loadfile``),
handed out in collection order; long modules handed out last would leave one worker running alone at the end.
"""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)  # stable: file order kept within
