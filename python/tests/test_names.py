"""Task and flow names are unique: a second definition under a taken name is refused when
it is decorated; the same definition again (a re-import, ``importlib.reload``, a spawned
child's ``__mp_main__``) is not a clash."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import ax_scheduler as ax
from ax_scheduler._flow import FLOWS
from ax_scheduler._task import REGISTRY

TASK = """
import ax_scheduler as ax

@ax.task(queue="py_tasks")
def py_process(x: int) -> str:
    return "{who}"

@ax.flow(name="py_process_flow")
def py_process_flow(event):
    py_process(event)
"""


@pytest.fixture
def modules(tmp_path: Path) -> Iterator[Path]:
    """A directory on ``sys.path`` for the test's modules; what they registered is removed."""
    tasks, flows = set(REGISTRY), set(FLOWS)
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in ("py_names_a", "py_names_b"):
        sys.modules.pop(name, None)
    for name in set(REGISTRY) - tasks:
        del REGISTRY[name]
    for name in set(FLOWS) - flows:
        del FLOWS[name]


def test_two_functions_under_one_task_name_are_refused_naming_both(modules: Path) -> None:
    (modules / "py_names_a.py").write_text(TASK.format(who="a"))
    (modules / "py_names_b.py").write_text(TASK.format(who="b"))
    first = importlib.import_module("py_names_a")
    with pytest.raises(ax.InvalidInput) as refused:
        importlib.import_module("py_names_b")
    message = str(refused.value)
    assert "py_names_a.py_process" in message and "py_names_b.py_process" in message, message
    assert "name=" in message, message
    assert REGISTRY["py_process"].fn is first.py_process.fn, "the first definition stays"


def test_two_flows_under_one_name_are_refused(modules: Path) -> None:
    (modules / "py_names_a.py").write_text(TASK.format(who="a"))
    importlib.import_module("py_names_a")

    def py_process_flow(event: Any) -> None:
        pass

    with pytest.raises(ax.InvalidInput, match="py_names_a.py_process_flow.*name="):
        ax.flow(name="py_process_flow")(py_process_flow)


def test_the_same_definition_again_is_no_clash(modules: Path) -> None:
    (modules / "py_names_a.py").write_text(TASK.format(who="a"))
    module = importlib.import_module("py_names_a")
    reloaded = importlib.reload(module)
    assert REGISTRY["py_process"].fn is reloaded.py_process.fn, "the reloaded function is served"
    code = compile("def py_main_task(x):\n    return x\n", "script.py", "exec")
    for main in ("__main__", "__mp_main__"):  # a script, then a spawned child importing it
        namespace: dict[str, Any] = {"__name__": main}
        exec(code, namespace)
        ax.task(queue="py_tasks")(namespace["py_main_task"])
    assert REGISTRY["py_main_task"].fn.__module__ == "__mp_main__"
