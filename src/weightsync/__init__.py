"""weightsync: storage and replication of model weights for RL post-training.

`weightsync.Publisher` and `weightsync.Subscriber` are the SDK (see weightsync.client);
they are imported on first use so `import weightsync` stays light.
"""

from __future__ import annotations

from typing import Any

from weightsync.common import VERSION as __version__

__all__ = ["Publisher", "Subscriber", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Publisher", "Subscriber"):
        from weightsync import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
