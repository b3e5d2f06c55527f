"""A trainer's weights into a running inference engine (vLLM), without a restart: from the
live model (``WeightPusher``) or from a checkpoint's step (``dcpkit push``)."""

from dcpkit.push.engines import EngineError
from dcpkit.push.pusher import PushResult, WeightPusher, push_weights

__all__ = ["EngineError", "PushResult", "WeightPusher", "push_weights"]
