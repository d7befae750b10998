"""Session-wide hooks: the multi-process harness's workers end with the test session."""

import sys


def pytest_sessionfinish(session, exitstatus):
    # Also on failure and Ctrl-C; a pytest that is killed outright is covered by the workers' own watchdog.
    testing = sys.modules.get("megatron_patch.testing")
    if testing is not None:
        testing.shutdown()
