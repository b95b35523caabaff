"""What the attempt policy (``attempts``) tells its driver to do next, and what the driver
reports back of a send (``Result``)."""

from __future__ import annotations

from ..errors import ProxyError
from ..health.fleet import Verdict
from ..scheduling.tickets import Ticket
from ..value import value
from .route import Deployment


@value
class LeaseAsk:
    """What to ask the shared state for: a slot of ``provider`` (``limit`` across
    replicas) for a waiter of ``rank``, waiting at most ``max_wait_s``."""

    provider: str
    limit: int
    rank: int
    waited_s: float
    max_wait_s: float
    key: str
    key_weight: float
    charged_s: float


@value
class Queue:
    """Wait in the scheduler with ``ticket`` (submitted anew or again) until granted."""

    ticket: Ticket


@value
class Send:
    """Call ``deployment`` now, holding the granted slot; then report ``finished``."""

    deployment: Deployment


@value
class Wait:
    """Back off until ``until``, then report ``resume``."""

    until: float


@value
class Fail:
    """Answer the client with the proxy's own error."""

    error: ProxyError


@value
class PassThrough:
    """Answer the client with the last upstream failure, as the upstream sent it."""


@value
class Done:
    """The client has its answer (or has left)."""


@value
class Reserve:
    """Reserve the call's cost on its key's budget before it goes through ``deployment``
    (``estimate``, at most ``maximum``), then report ``reserved``."""

    deployment: Deployment
    estimate: float
    maximum: float


@value
class LeaseSlot:
    """Lease one of the provider's slots across replicas (``ask``) before the call goes
    through ``deployment``, then report ``leased``."""

    deployment: Deployment
    ask: LeaseAsk


@value
class Hold:
    """The rest of the key's budget is reserved by its calls in flight: hold nothing and
    wait until one of them settles or until ``until``, then report ``held_over``."""

    key: str
    until: float


Command = Queue | Send | Wait | Fail | PassThrough | Done | Reserve | LeaseSlot | Hold


@value
class Result:
    """What became of a ``Send``."""

    verdict: Verdict
    status: int | None = None  # the upstream's HTTP status, when it answered
    retry_after_s: float | None = None
    committed: bool = False  # bytes reached the client: no further attempt
    error: ProxyError | None = None  # the proxy's own error when the upstream did not answer
    prompt_tokens: object = None  # as the upstream reported them
    completion_tokens: object = None
    ttft_s: float | None = None
    service_tier: object = None  # the tier the upstream says it served the call at


