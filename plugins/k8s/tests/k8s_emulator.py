"""An emulated Kubernetes API server on 127.0.0.1 for the k8s plugin's tests.

No real API server can run on the machines these tests run on, so the plugin's calls go
over real HTTP, through the official client and a real kubeconfig, to kmock's
``KubernetesEmulator`` (create, read, list, patch, delete; objects kept in memory), run in
a background thread with its own event loop. The emulator knows nothing of kubelets: the
tests play the kubelet by patching pods' ``status``. Two things it does not do that an API
server does are added here: a ``uid`` and ``creationTimestamp`` for every created object.
(It also ignores label selectors; the plugin filters lists by labels itself.)
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client

from dlrover_plugin_k8s import k8s_retrying

kmock = pytest.importorskip("kmock", reason="kmock (the emulated API server) is not installed: "
                                            "pip install -e 'plugins/k8s[test]'")

NAMESPACE = "ml"
IMAGE = "registry.example.com/dlrover:0.1"

#: resources the emulator serves before any object of theirs exists
_RESOURCES = {
    "v1/pods": "Pod", "v1/services": "Service", "v1/serviceaccounts": "ServiceAccount",
    "v1/configmaps": "ConfigMap", "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
}

_VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


class _Emulator(kmock.KubernetesEmulator):
    """The emulator, plus what the API server adds to every created object."""

    async def _handle(self, request):
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return await super()._handle(request)


class EmulatedCluster:
    """A running emulator: ``url``, ``kubeconfig`` (a file pointing at it), ``server`` (for
    kmock reactions such as ``server['get /path'] << 503``), and helpers that play the
    kubelet or look at what is stored."""

    def __init__(self, tmp: Path) -> None:
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"the emulated API server did not start: {self._error!r}")
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
            f"clusters:\n- name: emu\n  cluster:\n    server: {self.url}\n"
            "users:\n- name: emu\n  user:\n    token: test-token\n"
            f"contexts:\n- name: emu\n  context:\n    cluster: emu\n    user: emu\n    namespace: {NAMESPACE}\n")
        cfg = k8s_client.Configuration()
        cfg.host = self.url
        self.core = k8s_client.CoreV1Api(k8s_client.ApiClient(cfg))  # the "kubelet" and the test's own eyes

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by __init__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with _Emulator() as server, kmock.Server(server) as http:
            for key, kind in _RESOURCES.items():
                server.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=True, singular=kind.lower(),
                    verbs=_VERBS)
            # kmock names the core group "/v1" in its discovery; kubectl needs "v1"
            server["get /api/v1"] << {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": key.split("/")[-1], "singularName": kind.lower(), "kind": kind, "namespaced": True,
                 "verbs": sorted(_VERBS)} for key, kind in _RESOURCES.items() if key.startswith("v1/")]}
            self.server = server
            self.url = str(http.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    # ----- what is stored -----------------------------------------------------------------

    def objects(self, plural: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        """Live stored objects as ``{(plural, name): object}``."""
        out = {}
        for (resource, _ns, name), obj in list(self.server.objects.items()):
            if obj.deleted or (plural is not None and resource.plural != plural):
                continue
            out[(resource.plural, name)] = obj.raw
        return out

    def pods(self, **labels: str) -> dict[str, dict[str, Any]]:
        want = {k.replace("_", "-").replace("dlrover-", "dlrover."): v for k, v in labels.items()}
        return {name: obj for (_, name), obj in self.objects("pods").items()
                if all((obj["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())}

    def requests(self, method: str, path_part: str) -> int:
        """How many requests of ``method`` whose path contains ``path_part`` reached the server."""
        return sum(1 for r in list(self.server) if str(r.method).upper().endswith(method.upper())
                   and path_part in r.url.path)

    def fail_next(self, request: str, status: int, *, times: int = 1, reason: str = "ServiceUnavailable",
                  message: str = "the server is currently unable to handle the request") -> None:
        """Answer the next ``times`` requests matching ``request`` (e.g. ``"get /api/v1/..."``)
        with ``status`` and a Kubernetes Status body, then serve them normally again."""
        left = [times]

        def react(_request):
            if left[0] <= 0:
                return NotImplemented  # on to the emulator's own handling
            left[0] -= 1
            return kmock.Response(status=status, payload={
                "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status, "reason": reason,
                "message": message})

        self.server[request] << react

    # ----- the kubelet ------------------------------------------------------------------------

    def set_status(self, pod: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(pod, NAMESPACE, {"status": status})

    def fail(self, pod: str, *, exit_code: int = 1, reason: str = "Error", message: str | None = None,
             container: str = "agent") -> None:
        term: dict[str, Any] = {"exitCode": exit_code, "reason": reason}
        if message:
            term["message"] = message
        self.set_status(pod, {"phase": "Failed", "containerStatuses": [
            {"name": container, "ready": False, "restartCount": 0, "image": IMAGE, "imageID": "",
             "state": {"terminated": term}}]})



def instant_retrying():
    """The real policy, without the waiting."""
    return k8s_retrying(sleep=lambda _s: None)
