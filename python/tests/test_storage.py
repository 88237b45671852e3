"""``Runtime(storage=...)``, the workflow document's spelling: a directory (also as a
``sqlite:`` or ``file:`` URL) is the embedded runtime's data directory, a NATS URL is the
url, anything else a clear ``InvalidInput`` naming what to pass."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import ax_scheduler as ax
from ax_scheduler._embedded import free_port


@ax.task(queue="py_tasks")
def stored_echo(x: int) -> int:
    return x


@pytest.fixture
def no_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AX_URL", raising=False)
    monkeypatch.setenv("AX_LOCAL_PORT", str(free_port()))  # not 4222: another test may hold it


def test_the_documents_spelling_runs_the_embedded_runtime_in_that_directory(tmp_path, monkeypatch, no_url,
                                                                            caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="ax_scheduler"):
        rt = ax.Runtime(storage="sqlite:///./ax.db", executor="threadpool", max_concurrency=10, tasks=[stored_echo])
    said = [r.getMessage() for r in caplog.records if "storage=" in r.getMessage()]
    assert len(said) == 1 and "not a SQLite file" in said[0] and str(tmp_path / "ax.db") in said[0], said
    with rt:
        assert stored_echo.submit(3).result(timeout=30) == 3
    assert (tmp_path / "ax.db" / "jetstream").is_dir()


def test_storage_forms_map_and_others_are_refused_naming_what_to_pass(tmp_path, no_url):
    assert ax.Runtime(storage="nats://10.0.0.5:4222").url == "nats://10.0.0.5:4222"
    for given in (f"file://{tmp_path}/data", f"sqlite:///{tmp_path}/data", str(tmp_path / "data"), tmp_path / "data"):
        rt = ax.Runtime(storage=given)
        assert (rt.url, Path(rt.data_dir)) == (None, tmp_path / "data"), given
    for bad in ("postgresql://db/ax", "mysql://u@db/ax", "sqlite://", "redis://cache"):
        with pytest.raises(ValueError) as refused:  # ax.InvalidInput is a ValueError
            ax.Runtime(storage=bad)
        assert isinstance(refused.value, ax.InvalidInput) and refused.value.field == "storage"
        assert "nats://" in str(refused.value) and "sqlite:///" in str(refused.value), str(refused.value)
    (tmp_path / "real.db").write_bytes(b"SQLite format 3\0")
    with pytest.raises(ax.InvalidInput, match="directory"):
        ax.Runtime(storage=f"sqlite:///{tmp_path}/real.db")
    with pytest.raises(ax.InvalidInput, match="storage"):
        ax.Runtime("nats://127.0.0.1:4222", storage=str(tmp_path))
    with pytest.raises(ax.InvalidInput, match="storage"):
        ax.Runtime(storage=str(tmp_path), data_dir=tmp_path / "other")
