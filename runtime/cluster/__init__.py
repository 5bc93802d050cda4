"""``lmc serve --replicas N``: the OpenAI-compatible server over engine
replicas on Ray Serve (the ``cluster`` extra), routed by the KV blocks each
replica really holds.

* ``deploy``: Ray started or joined, the replicas deployed, the ingress app;
* ``replica``: one engine replica (a whole lmc engine) as a deployment;
* ``router`` and ``affinity``: the request router and its policy;
* ``backend``: the ingress's backend, streaming from the replicas;
* ``metrics``: the ingress's ``/metrics``, replicas labelled.

Nothing here is imported unless ``--replicas`` or ``--autoscale`` is given.
"""
