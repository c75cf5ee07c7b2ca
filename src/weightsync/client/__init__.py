"""The weightsync client SDK: publish versions, pull them into directories, apply them in place.

Speaks only the HTTP API of docs/API.md (httpx); needs neither the server
extra nor torch, except for the tensor paths (state_dict publishing,
`Subscriber.apply`), which import torch when called.

>>> pub = Publisher("http://127.0.0.1:8400", "policy-7b")
>>> pub.publish_async(model.state_dict(), step=step)          # training loop
>>> sub = Subscriber("http://127.0.0.1:8400", "policy-7b")
>>> sub.pull("/models/policy-7b")                                # a directory, byte for byte
>>> prepared = sub.prepare(); pause = sub.apply(tensors, prepared)   # in place, serving paused only here
"""

from weightsync.client._http import DEFAULT_SERVER
from weightsync.client.inplace import Prepared, TensorUpdate
from weightsync.client.models import PublishResult, PullResult, Version
from weightsync.client.publisher import Publisher, publish
from weightsync.client.subscriber import Subscriber
from weightsync.client.wire import Retry, TokenBucket

__all__ = [
    "DEFAULT_SERVER",
    "Prepared",
    "PublishResult",
    "Publisher",
    "PullResult",
    "Retry",
    "Subscriber",
    "TensorUpdate",
    "TokenBucket",
    "Version",
    "publish",
]
