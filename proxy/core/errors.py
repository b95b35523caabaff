"""The proxy's one error hierarchy.

Every error the proxy itself produces is a ``ProxyError``. Each class carries the HTTP
status, the OpenAI error ``type`` and ``code`` it is rendered with; exactly one middleware
(``proxy.http.call.middleware``) turns it into ``{"error": {...}}``.

    ProxyError
    ├── InvalidRequest        400 invalid_request
    ├── InvalidApiKey         401 invalid_api_key
    ├── InvalidAdminKey       401 invalid_admin_key (/admin/* with admin.key configured)
    ├── AdminLoopbackOnly     403 admin_loopback_only (/admin/* from afar, no admin.key)
    ├── InvalidConfig         400 invalid_config (a reload found the file invalid)
    ├── ModelNotFound         404 model_not_found
    ├── NotFound              404 not_found (a file, batch or response: none of the key's)
    ├── StorageFull           507 storage_full (storage.max_bytes reached)
    ├── RequestTooLarge       413 request_too_large
    ├── BodyTimeout           408 request_timeout (the body did not arrive in time)
    ├── RateLimited           429 rate_limit_exceeded
    │   └── KeyBacklog            key_backlog (the key's own calls ahead outlast the wait)
    ├── BudgetExceeded        429 budget_exceeded (the key's budget_usd is spent)
    ├── Overloaded            503 (retry-after set)
    │   ├── QueueFull             queue_full
    │   ├── Evicted               evicted
    │   ├── QueueTimeout          queue_timeout
    │   ├── Shed                  shed (expected wait past the model's degrade.shed_wait_s)
    │   ├── ShuttingDown          shutting_down (draining: the call cannot finish in time)
    │   ├── StateUnavailable      state_unavailable (Redis unreachable, state.on_error: reject)
    │   ├── StorageUnavailable    storage_unavailable (the store of work that can wait)
    │   └── UpstreamUnavailable   upstream_unavailable
    └── UpstreamError         502 / 504, raised when every attempt failed
        ├── UpstreamConnectError  502 upstream_connect_error
        ├── UpstreamTimeout       504 upstream_timeout
        ├── UpstreamBadResponse   502 upstream_error
        └── UpstreamAuthError     502 upstream_auth_error (the provider refused the proxy's
                                      own key: never the client's fault, never its body)
"""

from __future__ import annotations

import math


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    retryable: bool | None = None  # the default of x-should-retry; None sends nothing
    closes = False  # the answer closes the connection (what follows may not be a request)

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.should_retry = self.retryable if should_retry is None else should_retry

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            seconds = max(0.0, self.retry_after)
            headers["retry-after"] = str(max(1, math.ceil(seconds)))
            headers["retry-after-ms"] = str(int(seconds * 1000))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers


class InvalidRequest(ProxyError):
    status = 400
    retryable = False
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidApiKey(ProxyError):
    status = 401
    retryable = False
    type = "invalid_request_error"
    code = "invalid_api_key"


class InvalidAdminKey(ProxyError):
    status = 401
    retryable = False
    type = "invalid_request_error"
    code = "invalid_admin_key"


class InvalidConfig(ProxyError):
    status = 400
    retryable = False
    type = "invalid_request_error"
    code = "invalid_config"


class AdminLoopbackOnly(ProxyError):
    status = 403
    retryable = False
    type = "invalid_request_error"
    code = "admin_loopback_only"


class ModelNotFound(ProxyError):
    status = 404
    retryable = False
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(ProxyError):
    status = 404
    retryable = False
    type = "invalid_request_error"
    code = "not_found"


class StorageFull(ProxyError):
    status = 507
    retryable = False
    type = "server_error"
    code = "storage_full"


class RequestTooLarge(ProxyError):
    status = 413
    retryable = False
    type = "invalid_request_error"
    code = "request_too_large"


class BodyTimeout(ProxyError):
    status = 408
    retryable = True
    closes = True  # the rest of its body may still come
    type = "invalid_request_error"
    code = "request_timeout"


class RateLimited(ProxyError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class KeyBacklog(RateLimited):
    code = "key_backlog"


class BudgetExceeded(ProxyError):
    status = 429
    retryable = False  # not before the period ends: retry-after says when
    type = "insufficient_quota"
    code = "budget_exceeded"


class Overloaded(ProxyError):
    status = 503
    type = "server_error"
    code = "overloaded"


class QueueFull(Overloaded):
    code = "queue_full"


class Evicted(Overloaded):
    code = "evicted"


class QueueTimeout(Overloaded):
    code = "queue_timeout"


class Shed(Overloaded):
    code = "shed"


class ShuttingDown(Overloaded):
    code = "shutting_down"

    def __init__(self, message: str = "The proxy is shutting down and the call could not "
                 "finish in time; retry it (on another replica).") -> None:
        super().__init__(message, retry_after=1.0)


class UpstreamUnavailable(Overloaded):
    code = "upstream_unavailable"


class StorageUnavailable(Overloaded):
    code = "storage_unavailable"

    def __init__(self) -> None:
        super().__init__("The proxy cannot reach its store of files, batches and background "
                         "responses; retry shortly.", retry_after=1.0)


class StateUnavailable(Overloaded):
    code = "state_unavailable"

    def __init__(self, message: str = "The proxy cannot reach its shared state (Redis) and "
                 "is configured to refuse calls meanwhile.") -> None:
        super().__init__(message, retry_after=1.0)


class UpstreamError(ProxyError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamBadResponse(UpstreamError):
    code = "upstream_error"


class UpstreamAuthError(UpstreamError):
    code = "upstream_auth_error"
