from tests.support.fixtures import (  # noqa: F401  (fixtures)
    attach_nodes,
    make_nodes,
    make_rendezvous,
    operator_process,
    recorded,
    rendezvous_crd,
    workers_namespace,
)
