"""Fixtures of the k8s plugin's tests: an emulated API server (``k8s_emulator``) and the
backend pointed at it through a kubeconfig."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dlrover_plugin_k8s import K8sConfig, K8sScheduler, KubeApi


@pytest.fixture
def cluster(tmp_path) -> Iterator[Any]:
    """A running emulated API server (:class:`k8s_emulator.EmulatedCluster`)."""
    from k8s_emulator import EmulatedCluster

    c = EmulatedCluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def config(cluster) -> K8sConfig:
    from k8s_emulator import IMAGE, NAMESPACE

    return K8sConfig(image=IMAGE, namespace=NAMESPACE, kubeconfig=str(cluster.kubeconfig), checkpoint_pvc="ckpt")


@pytest.fixture
def api(config) -> KubeApi:
    from k8s_emulator import instant_retrying

    return KubeApi(config, retrying=instant_retrying, timeout_s=5.0)


@pytest.fixture
def backend(config, api) -> K8sScheduler:
    return K8sScheduler(config, api=api, cancel_wait_s=2.0)
