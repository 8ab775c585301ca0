from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest
from tests.contract.job import (
    BACKENDS,
    C10dPlace,
    Job,
    KubernetesPlace,
    Place,
    backend_param,
)


@pytest.fixture(params=[backend_param(backend) for backend in BACKENDS])
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Job]:
    """The scenario's agents over the parametrized backend. Only ``kubernetes`` asks for
    the control plane, the operator and a namespace: c10d needs none of them."""
    place: Place
    if request.param == "kubernetes":
        request.getfixturevalue("operator_process")
        admin_api: kubernetes.client.ApiClient = request.getfixturevalue("admin_api")
        place = KubernetesPlace(
            request.getfixturevalue("control_plane"),
            admin_api,
            request.getfixturevalue("workers_namespace"),
            request.getfixturevalue("make_rendezvous"),
            tmp_path,
        )
    else:
        place = C10dPlace(tmp_path)
    running = Job(place, tmp_path)
    try:
        yield running
    finally:
        running.stop()
        print(running.describe(lines=15))
