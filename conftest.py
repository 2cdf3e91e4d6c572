"""The whole suite's collection: how ``make test`` spreads it over processes.

``make test`` runs pytest with pytest-xdist (``--dist loadgroup``): a test goes to whichever
worker process is free, except that the tests of a file that share an expensive fixture
(one of the file's own, or a conftest's, wider than a function: a job shared by its tests,
a docker daemon) stay on one worker, so it starts once; and files that share something
machine-wide share a group, so they never run at the same time: the Slurm tests (each
file's session starts a Slurm controller and node daemons on fixed ports). A test may name
its own group (``@pytest.mark.xdist_group("name")``).
"""

from __future__ import annotations

import pytest

#: Files (by the folder they are in) that run on one worker, one after the other.
_SHARED = {"plugins/slurm/tests": "slurm"}


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture of the project's tests wider than one test (pytest's
    own and plugins' fixtures, e.g. ``tmp_path_factory``, have no ``baseid``)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope != "function" and d.baseid for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        path = item.path.relative_to(config.rootpath).as_posix()
        group = next((g for folder, g in _SHARED.items() if path.startswith(folder + "/")), None)
        if group is None and _shares_a_fixture(item):
            group = path
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
