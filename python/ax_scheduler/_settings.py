"""Task settings files (``tasks:`` of a settings file, PROTOCOL.md §8) as data: read from
YAML or JSON, times made seconds."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, cast

from .errors import InvalidInput


def file_words(value: Any) -> Any:
    """Timedeltas as seconds, anywhere in the settings."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: file_words(v) for k, v in cast(dict[Any, Any], value).items()}
    if isinstance(value, (list, tuple)):
        return [file_words(v) for v in cast(list[Any], value)]
    return value


def load(path: str | os.PathLike[str]) -> Any:
    """A settings file's data: JSON for ``.json``, else YAML (the ``yaml`` extra)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if str(path).endswith(".json"):
        return json.loads(text)
    try:
        import yaml
    except ImportError:
        raise InvalidInput(f"{path}: reading YAML needs PyYAML: pip install 'ax-scheduler[yaml]' "
                           "(or give the settings as JSON)", field="config") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidInput(f"{path} is not valid YAML: {e}", field="config") from None
