"""Local path or Hugging Face hub id? One rule for `data.source` and `model.path`.

A source that exists on disk is a path. One that does not exist is a hub id only when it is spelled like one
(`org/name`, optionally `org/name:config`: one slash, no leading `/`, `.` or `~`, no data-file suffix);
anything else path-like is a missing file, reported at once instead of becoming a hub lookup. Before a hub
id is looked up, a quick reachability check (one HEAD request, a few seconds at most) turns "no network"
into one line, where the hub clients would retry for a minute with a warning per attempt.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt", ".yaml", ".safetensors", ".gguf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")


def is_hub_id(source: str) -> bool:
    """`org/name` (or `org/name:config`) spelled as a hub id, not as a path."""
    if not _HUB_ID.match(source):
        return False
    name = source.partition(":")[0]
    return not name.lower().endswith(DATA_SUFFIXES) and not Path(name.partition("/")[0]).exists()


def local_path(source: str) -> Path | None:
    """The local path `source` names (`~` expanded), or None when it should be read as a hub id."""
    path = Path(source).expanduser()
    if path.exists() or not is_hub_id(source):
        return path
    return None


def explicitly_offline() -> bool:
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def unreachable_reason(timeout_s: float = 3.0) -> str | None:
    """Why the hub cannot be reached (checked once per process), or None when it answers.

    Any HTTP answer, even an error status, means the hub is reachable; proxies from the environment apply."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{endpoint} is unreachable ({reason})"
    return None


def require_hub(field: str, source: str, error: type[Exception], hint: str | None = None) -> None:
    """Raise `error` (one line naming the field, and `hint` when given) when a hub id cannot be looked up
    because we are offline.

    With HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set the hub client reads its local cache (fast, no retries),
    so only an implicit offline state is checked here."""
    if explicitly_offline():
        return
    reason = unreachable_reason()
    if reason is not None:
        advice = f"; {hint}" if hint else ""
        raise error(f"{field}: {source}: no such local file or folder, and as a hub id it cannot be fetched: "
                    f"{reason} (set HF_HUB_OFFLINE=1 to use the local hub cache){advice}")
