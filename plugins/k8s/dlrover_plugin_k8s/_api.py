"""Calls to the Kubernetes API, through the official client, as plain dicts.

Every call goes through :func:`k8s_retrying`: transient answers (HTTP 429, 500, 502, 503,
504) and connection errors are retried, boundedly; any other refusal (403 Forbidden, 404 Not
Found, 409 Conflict, 422 Invalid...) raises :class:`K8sApiError` at once, carrying the API
server's own message. Reads ask for the raw JSON (``_preload_content=False``), so objects
are handled exactly as the API serves them (camelCase dicts), never as generated models.

The client is configured from, in order: an explicit kubeconfig (``K8sConfig.kubeconfig``);
the pod's service account when running inside a cluster (``KUBERNETES_SERVICE_HOST`` set);
else ``$KUBECONFIG`` or ``~/.kube/config``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import tenacity
import urllib3

if TYPE_CHECKING:
    from kubernetes import client as k8s_client
    from kubernetes.client.exceptions import ApiException

from dlrover_core import SchedulerError
from dlrover_core.backend import api_retrying, get_logger
from dlrover_plugin_k8s._config import K8sConfig

__all__ = ["KubeApi", "K8sApiError", "TRANSIENT_STATUSES", "k8s_retrying"]

log = get_logger()

#: HTTP answers of the API server worth retrying: throttled, or the server is in trouble.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Read timeout of a followed log (seconds): a container may print nothing for a long time.
_FOLLOW_READ_TIMEOUT_S = 24 * 3600.0


class K8sApiError(SchedulerError):
    """The Kubernetes API refused a request (or kept failing it).

    Attributes:
        status: the HTTP status (``0``: no answer, e.g. the server could not be reached).
        reason: the API's reason (``"Forbidden"``, ``"Invalid"``, ``"NotFound"``...).
        api_message: the API server's own message, verbatim.
        action: what was being done, e.g. ``"create Pod ml/charlm-...-master"``.
    """

    def __init__(self, action: str, status: int, reason: str, api_message: str) -> None:
        self.action = action
        self.status = status
        self.reason = reason
        self.api_message = api_message
        super().__init__(f"kubernetes API refused to {action}: HTTP {status} {reason}: {api_message}")


def _kube() -> Any:
    """The ``kubernetes`` package, imported on first use: loading the plugins (every worker,
    agent and master does, whatever its scheduler) must not pay the 0.35 s of importing it."""
    import kubernetes  # heavy: the client, its models, pydantic

    return kubernetes


def _is_api_exception(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the client's ``ApiException`` (without importing the client for it:
    no ApiException can exist before the client is imported)."""
    return "kubernetes" in sys.modules and isinstance(exc, _kube().client.exceptions.ApiException)


def _is_transient(exc: BaseException) -> bool:
    if _is_api_exception(exc):
        return exc.status in TRANSIENT_STATUSES
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def _retry_after_s(exc: BaseException | None) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    try:
        value = headers.get("Retry-After")
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


class _wait_retry_after(tenacity.wait.wait_base):
    """Wait what a 429/503 answer's ``Retry-After`` header asks, capped at ``max_s``;
    otherwise fall back to ``fallback``."""

    def __init__(self, fallback: tenacity.wait.wait_base, max_s: float) -> None:
        self.fallback = fallback
        self.max_s = max_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        asked = _retry_after_s(exc)
        if asked is not None:
            return min(max(asked, 0.0), self.max_s)
        return self.fallback(retry_state)


def k8s_retrying(
    *,
    attempts: int = 5,
    max_total_s: float = 30.0,
    initial_wait_s: float = 0.2,
    max_wait_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> tenacity.Retrying:
    """Policy for calls to the Kubernetes API.

    Retries transient failures (HTTP 429/500/502/503/504, connection errors) at most
    ``attempts`` times in all and for at most ``max_total_s`` seconds, waiting
    exponentially with jitter from ``initial_wait_s`` up to ``max_wait_s``, or what a
    ``Retry-After`` header asks (capped the same). Re-raises the last error.
    """
    return api_retrying(
        _is_transient, attempts=attempts, max_total_s=max_total_s, initial_wait_s=initial_wait_s, max_wait_s=max_wait_s,
        wait=lambda backoff: _wait_retry_after(backoff, max_wait_s),
        before_sleep=lambda rs: log.warning(
            "k8s_api_retry", attempt=rs.attempt_number,
            error=_describe(rs.outcome.exception()) if rs.outcome else None),
        sleep=sleep,
    )


def _describe(exc: BaseException | None) -> str:
    if _is_api_exception(exc):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _api_message(exc: ApiException) -> tuple[str, str]:
    """``(reason, message)`` from a Kubernetes ``Status`` body (or the raw body)."""
    reason, message = str(exc.reason or ""), ""
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if body:
        try:
            status = json.loads(body)
            if isinstance(status, dict):
                reason = str(status.get("reason") or reason)
                message = str(status.get("message") or "")
        except ValueError:
            message = body.strip()[:500]
    return reason, message or reason or "no message"


def load_client_configuration(config: K8sConfig) -> k8s_client.Configuration:
    """A client configuration (see the module docstring for the order); our retries only."""
    kube = _kube()
    cfg = kube.client.Configuration()
    try:
        if config.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube.config.load_incluster_config(client_configuration=cfg)
        else:
            kube.config.load_kube_config(config_file=config.kubeconfig, context=config.context,
                                         client_configuration=cfg, persist_config=False)
    except (kube.config.config_exception.ConfigException, OSError) as exc:
        raise SchedulerError(f"no Kubernetes configuration: {exc}. Set DLROVER_K8S_KUBECONFIG or KUBECONFIG, "
                             "or run inside a cluster") from exc
    cfg.retries = False  # every retry is ours (k8s_retrying), counted and bounded
    return cfg


#: kind -> (API class, method suffix): ``create_namespaced_<suffix>`` and friends.
_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("core", "pod"),
    "Service": ("core", "service"),
    "ServiceAccount": ("core", "service_account"),
    "ConfigMap": ("core", "config_map"),
    "Role": ("rbac", "role"),
    "RoleBinding": ("rbac", "role_binding"),
}


def labels_match(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class KubeApi:
    """The few API calls the backend makes, retried and with errors mapped.

    Args:
        config: where the API server is (kubeconfig, context).
        retrying: factory of the retry policy (default :func:`k8s_retrying`).
        timeout_s: timeout of one request (connect and read), seconds.
        api_client: an already configured ``kubernetes.client.ApiClient`` (tests).
    """

    def __init__(
        self,
        config: K8sConfig,
        *,
        retrying: Callable[[], tenacity.Retrying] = k8s_retrying,
        timeout_s: float = 15.0,
        api_client: k8s_client.ApiClient | None = None,
    ) -> None:
        k8s_client = _kube().client
        self.client = api_client or k8s_client.ApiClient(load_client_configuration(config))
        self._apis = {"core": k8s_client.CoreV1Api(self.client), "rbac": k8s_client.RbacAuthorizationV1Api(self.client)}
        self._retrying = retrying
        self.timeout_s = timeout_s

    # ----- plumbing ---------------------------------------------------------------------

    def call(self, action: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under the retry policy; map a refusal to :class:`K8sApiError`."""
        try:
            for attempt in self._retrying():
                with attempt:
                    return fn()
        except Exception as exc:
            if _is_api_exception(exc):
                reason, message = _api_message(exc)  # type: ignore[arg-type]
                raise K8sApiError(action, int(exc.status or 0), reason, message) from exc  # type: ignore[attr-defined]
            if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
                raise K8sApiError(action, 0, "Unreachable", f"{type(exc).__name__}: {exc}") from exc
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _method(self, verb: str, kind: str) -> Callable[..., Any]:
        try:
            group, suffix = _KINDS[kind]
        except KeyError:
            raise SchedulerError(f"the k8s backend does not handle objects of kind {kind!r}") from None
        return getattr(self._apis[group], f"{verb}_namespaced_{suffix}")

    def _json(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        response = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
        try:
            return json.loads(response.data or b"null")
        finally:
            response.release_conn()

    # ----- objects ----------------------------------------------------------------------

    def create(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create ``obj`` (a manifest); the created object as the server returns it.

        ``dry_run``: the server validates and admits it but stores nothing.
        """
        kind, meta = obj["kind"], obj["metadata"]
        ns, name = meta.get("namespace") or "default", meta["name"]
        fn = self._method("create", kind)
        extra = {"dry_run": "All"} if dry_run else {}
        return self.call(f"create {kind} {ns}/{name}", lambda: self._json(fn, ns, obj, **extra))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        fn = self._method("read", kind)
        try:
            return self.call(f"read {kind} {namespace}/{name}", lambda: self._json(fn, name, namespace))
        except K8sApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects of ``kind`` carrying every label in ``labels`` (filtered here too, so a
        server that ignores label selectors cannot widen the answer)."""
        fn = self._method("list", kind)
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        try:
            answer = self.call(f"list {kind} in {namespace} ({selector})",
                               lambda: self._json(fn, namespace, label_selector=selector))
        except K8sApiError as exc:
            if exc.status == 404:  # the namespace (or the resource type) does not exist
                return []
            raise
        return [item for item in (answer or {}).get("items") or [] if labels_match(item, labels)]

    def delete(self, kind: str, namespace: str, name: str, *, grace_period_s: int | None = None) -> bool:
        """Delete the object; ``False`` if it did not exist (deleting is idempotent)."""
        fn = self._method("delete", kind)
        extra: dict[str, Any] = {"propagation_policy": "Background"}
        if grace_period_s is not None:
            extra["grace_period_seconds"] = grace_period_s
        try:
            self.call(f"delete {kind} {namespace}/{name}", lambda: self._json(fn, name, namespace, **extra))
        except K8sApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # ----- logs and the master's API ------------------------------------------------------

    def pod_log(self, namespace: str, pod: str, container: str, *, tail_lines: int | None = None) -> bytes:
        """The container's log (its last ``tail_lines`` lines when given)."""
        core = self._apis["core"]
        extra = {"tail_lines": tail_lines} if tail_lines is not None else {}

        def read() -> bytes:
            response = core.read_namespaced_pod_log(pod, namespace, container=container, _preload_content=False,
                                                    _request_timeout=self.timeout_s, **extra)
            try:
                return response.data or b""
            finally:
                response.release_conn()

        return self.call(f"read the log of {namespace}/{pod} ({container})", read)

    def follow_pod_log(self, namespace: str, pod: str, container: str) -> Iterator[bytes]:
        """Chunks of the container's log as it grows, until the container ends (or the
        stream breaks). Only opening the stream is retried."""
        core = self._apis["core"]
        response = self.call(
            f"follow the log of {namespace}/{pod} ({container})",
            lambda: core.read_namespaced_pod_log(pod, namespace, container=container, follow=True,
                                                 _preload_content=False,
                                                 _request_timeout=(self.timeout_s, _FOLLOW_READ_TIMEOUT_S)))
        try:
            yield from response.stream(4096, decode_content=True)
        finally:
            response.release_conn()

    def service_proxy(self, namespace: str, service: str, port: int | str, path: str, *, post: bool = False,
                      timeout_s: float = 3.0) -> Any:
        """Call the job master's HTTP API through the API server's service proxy (reaches
        it from outside the cluster). One try with a short timeout, no mapping: callers
        treat any error as "the master cannot be reached"."""
        core = self._apis["core"]
        call = (core.connect_post_namespaced_service_proxy_with_path if post
                else core.connect_get_namespaced_service_proxy_with_path)
        response = call(f"{service}:{port}", namespace, path, _preload_content=False, _request_timeout=timeout_s)
        try:
            return json.loads(response.data or b"null")
        finally:
            response.release_conn()
