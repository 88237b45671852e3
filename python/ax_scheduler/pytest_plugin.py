"""ax's pytest plugin: the fixture ``ax_local``, a real local ax for integration tests.

Registered by the package's ``pytest11`` entry point; or, explicitly, in a test module
or the root ``conftest.py``: ``pytest_plugins = ["ax_scheduler.pytest_plugin"]``.

``ax_local`` (session scope) is an ``ax.testing.LocalAx``: a nats-server with JetStream
on a free port and a temporary directory, and an ax server in the test process, started
at its first use and stopped at the end of the session. ``ax_local.runtime(*tasks)``
starts an ``ax.Runtime`` for those tasks, stopped at the end of the test;
``ax_local.client`` is an ``ax.Client`` on it; ``ax_local.run(task, ...)`` /
``ax_local.run_flow(flow, input)`` run through it and answer the test mode's
``Result`` / ``FlowResult``.

ini options (pyproject ``[tool.pytest.ini_options]``), read when the plugin is
registered at start-up (the entry point, or ``pytest_plugins`` in the root conftest):
``ax_queues`` queues the server declares at start (others are declared when a runtime
or a flow run needs them), ``ax_ack_wait`` the ready consumers' ack wait in seconds
(default 2: a task whose worker died comes back within it).
"""

from __future__ import annotations

import logging
from typing import Iterator, cast

import pytest

from .testing import LocalAx

log = logging.getLogger("ax_scheduler.testing")
_LIVE: list[LocalAx] = []
_DEFAULT_QUEUES = ["default"]
_DEFAULT_ACK_WAIT = 2.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("ax_queues", "queues the ax_local fixture's server declares at start (others as needed)",
                  type="args", default=list(_DEFAULT_QUEUES))
    parser.addini("ax_ack_wait", "ack wait of the ax_local fixture's queues, seconds", default=str(_DEFAULT_ACK_WAIT))


def _ini(config: pytest.Config, name: str, default: object) -> object:
    """An ini option, or ``default`` when the plugin was registered after start-up (from a
    test module's ``pytest_plugins``: ``pytest_addoption`` came too late to declare it)."""
    try:
        return config.getini(name)
    except ValueError:
        log.debug("ax: ini option %s is not declared (the plugin was loaded by a test module): default %r",
                  name, default)
        return default


@pytest.fixture(scope="session")
def ax_local(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[LocalAx]:
    """A real local ax for the session: nats-server + an ax server in this process."""
    given = _ini(pytestconfig, "ax_queues", _DEFAULT_QUEUES)
    queues = [str(q) for q in cast("list[object]", given)] if isinstance(given, list) else _DEFAULT_QUEUES
    ack_wait = float(str(_ini(pytestconfig, "ax_ack_wait", _DEFAULT_ACK_WAIT)))
    env = LocalAx(tmp_path_factory.mktemp("ax-local"), queues=queues, ack_wait=ack_wait).start()
    _LIVE.append(env)
    try:
        yield env
    finally:
        _LIVE.remove(env)
        env.close()


@pytest.fixture(autouse=True)
def _ax_local_runtimes() -> Iterator[None]:
    """Stops, after each test, the runtimes it started with ``ax_local.runtime()``."""
    yield
    for env in list(_LIVE):
        env.stop_runtimes()
