from tests.support.fixtures import (  # noqa: F401  (fixtures)
    operator_process,
    rendezvous_crd,
    workers_namespace,
)
