"""Session-wide hooks: tests marked ``gpu`` are skipped where torch sees no CUDA device; the multi-process harness's
workers end with the test session; no test leaves a process group in pytest's own process; ``job``, a test's result
of its module's side-by-side jobs (tests/side_by_side.py)."""

import os
import sys

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def pytest_sessionfinish(session, exitstatus):
    # Also on failure and Ctrl-C; a pytest that is killed outright is covered by the workers' own watchdog.
    testing = sys.modules.get("megatron_patch.testing")
    if testing is not None:
        testing.shutdown()


@pytest.fixture(autouse=True)
def no_process_group_in_pytest():
    """A conversion or model built in pytest's own process starts a one-rank world there and sets MASTER_PORT, which
    every later launch inherits while that world still holds the port (EADDRINUSE in a dozen unrelated tests)."""
    before = os.environ.get("MASTER_PORT")
    yield
    after = os.environ.get("MASTER_PORT")
    if after != before:
        if before is None:
            del os.environ["MASTER_PORT"]
        else:
            os.environ["MASTER_PORT"] = before
        pytest.fail(f"this test set MASTER_PORT={after} in pytest's own process (a process group started there): "
                    "run the body in a rank with megatron_patch.testing.run_on_ranks", pytrace=False)


@pytest.fixture
def job(jobs, request):
    """This test's job's result (raising what the job raised), from its module's ``jobs`` fixture."""
    if request.node.name not in jobs:
        pytest.fail(f"no job of {request.node.name} in its module's JOBS (keys are pytest names, with parameters)")
    return jobs[request.node.name].result()
