"""The whole suite's collection: how ``make test`` spreads it over processes.

``make test`` runs pytest with pytest-xdist (``-n 2 --dist loadgroup``): each test file stays
on one worker process (its module fixtures start once: a job shared by its tests, a docker
daemon), and files that share something machine-wide share a group, so they never run at the
same time: the Slurm tests (each file's session starts a Slurm controller and node daemons).
A test may name its own group (``@pytest.mark.xdist_group("name")``).
"""

from __future__ import annotations

import pytest

#: Files (by the folder they are in) that run on one worker, one after the other.
_SHARED = {"plugins/slurm/tests": "slurm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        path = item.path.relative_to(config.rootpath).as_posix()
        group = next((g for folder, g in _SHARED.items() if path.startswith(folder + "/")), path)
        item.add_marker(pytest.mark.xdist_group(group))
