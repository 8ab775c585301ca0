"""The wire format of the ``Rendezvous`` resource and of a node's Lease: what the pods and
the operator share, as frozen dataclasses with camelCase codecs and a schema version.

It imports only the standard library: the operator image has no torch, and the pod side
must stay cheap to import (torch imports every registered plugin at start-up).

One writer per object and field:

* a node's Lease ``<rendezvous>.<pod>`` (:mod:`.leases`) -- its heartbeat and its
  request (annotation ``k8s-rendezvous.dev/entry``), written only by that pod. Every node
  writes its own object, so joins never contend for one resource's optimistic write;
* the Rendezvous status (:mod:`.statuses`) -- written only by the operator, which alone
  seals rounds; its spec (:mod:`.specs`) by the user, or by the operator from a Job's
  annotations;
* the RendezvousSlices of a large rendezvous (``status.slices`` > 0) -- written only by the
  operator after each status write: the round as the nodes of one slice need it, so that
  each node receives about :data:`.objects.SLICE_MEMBERS` members of a sealed round, not
  all of them. A node reads either as its :class:`.views.NodeView`.
"""
