"""Run the slow jobs of a test module's selected tests side by side, each test then checking its own job's result.

    JOBS = {"test_stopped_rank[0]": (_stopped_rank, 0), "test_stopped_rank[1]": (_stopped_rank, 1)}

    @pytest.fixture(scope="module")
    def jobs(assets, tmp_path_factory, request):
        yield from side_by_side(request, tmp_path_factory, JOBS, assets)

    @pytest.mark.parametrize("stopped", [0, 1])
    def test_stopped_rank(job, stopped):  # `job` (tests/conftest.py): this test's job's result
        status, output = job

CI has two cores. A job of one process, or one that waits (for a timeout, a stopped rank, a save), leaves a core
idle; jobs in threads, each driving its own subprocesses, fill it. A module lists its jobs in a dict, by the pytest
name of the test that checks each (or by a name of their own); ``side_by_side`` starts those the selected tests
need, and each test waits for its job's result (an exception the job raised is raised again there, with the job's
traceback).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

# One job per core of CI's two. A third would fill more of the gaps (start-up, saves, waits) but slows every job
# by half again, and each job's subprocess timeout is sized for the job running alone.
WORKERS = 2


@dataclasses.dataclass(frozen=True)
class After:
    """A job argument: the future of the job of this name, which is started first."""

    name: str


def side_by_side(request, tmp_path_factory, jobs: dict[str, tuple], *common: Any,
                 workers: int = WORKERS) -> Iterator[dict[str, Future]]:
    """Body of a module-scoped fixture: yield ``{name: future}`` of the jobs in ``jobs`` that the module's selected
    tests need, started at once, ``workers`` at a time; wait for all of them when the module is done.

    ``jobs[name] = (function, *arguments)`` runs ``function(*common, root, *arguments)`` with a fresh directory
    ``root`` and each ``After(other)`` argument replaced by the other job's future. A job is needed when a selected
    test has its name or uses a fixture of its name, or a needed job names it in an ``After``; a job must come after
    those it names in ``jobs``, so that one that waits for another never holds a thread the other still needs.
    """
    names = set()
    for item in request.session.items:
        if item.module is request.module:
            names.add(item.name)
            names.update(item.fixturenames)
    needed = [name for name in jobs if name in names]
    for name in needed:  # grows while it is read: each job's own needs join the end
        needed += [arg.name for arg in jobs[name][1:] if isinstance(arg, After) and arg.name not in needed]
    with ThreadPoolExecutor(workers, thread_name_prefix="job") as pool:  # its exit waits for every job
        futures: dict[str, Future] = {}
        for name, (function, *arguments) in jobs.items():
            if name in needed:
                root = tmp_path_factory.mktemp(function.__name__.strip("_"))
                arguments = [futures[arg.name] if isinstance(arg, After) else arg for arg in arguments]
                futures[name] = pool.submit(function, *common, root, *arguments)
        yield futures
