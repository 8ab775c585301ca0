from tests.support.fixtures import (  # noqa: F401  (fixtures)
    make_rendezvous,
    operator_process,
    recorded,
    rendezvous_crd,
    workers_namespace,
)
