"""Session-wide hooks: the multi-process harness's workers end with the test session; ``job``, a test's result of
its module's side-by-side jobs (tests/side_by_side.py)."""

import sys

import pytest


def pytest_sessionfinish(session, exitstatus):
    # Also on failure and Ctrl-C; a pytest that is killed outright is covered by the workers' own watchdog.
    testing = sys.modules.get("megatron_patch.testing")
    if testing is not None:
        testing.shutdown()


@pytest.fixture
def job(jobs, request):
    """This test's job's result (raising what the job raised), from its module's ``jobs`` fixture."""
    if request.node.name not in jobs:
        pytest.fail(f"no job of {request.node.name} in its module's JOBS (keys are pytest names, with parameters)")
    return jobs[request.node.name].result()
