"""Every endpoint a proxied call comes in on, named once: its path, the wire format of its
body and what the proxy does with it. The handlers (``http.call.forward``), the fast lane,
the middleware's per-call metrics, tracing, the Batch API and the access-log reader of
the simulator all read this table, so a new endpoint is one line here.
"""

from __future__ import annotations

from ..value import value
from .request import Kind


@value
class Endpoint:
    path: str
    kind: Kind  # the wire format of the body and its answer
    operation: str  # its GenAI semantic-convention operation name (traces)
    generates: bool  # produces output tokens: a call the simulator replays from a log
    batch: bool  # a line of a Batch API input file may name it


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/chat/completions", "chat", "chat", True, True),
    Endpoint("/v1/completions", "completions", "text_completion", True, True),
    Endpoint("/v1/responses", "responses", "chat", True, True),
    Endpoint("/v1/embeddings", "embeddings", "embeddings", False, True),
    Endpoint("/v1/messages", "messages", "chat", True, False),
)
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS}
# Anthropic's Messages API: the paths under it answer errors in Anthropic's shape; its
# token count is answered by the proxy itself (not a call: never queued nor sent).
ANTHROPIC_PREFIX = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
PATH_OF: dict[Kind, str] = {e.kind: e.path for e in ENDPOINTS}
