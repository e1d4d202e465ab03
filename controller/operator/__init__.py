"""Kubernetes: CRD generation, TOML <-> CR conversion, and the kopf operator.

``crd`` and ``convert`` are pure (the CLI uses them without kopf); ``source`` turns CRs
into the desired state the loader produces and writes it through the guard; ``status``
maps observed state to CR status; ``run`` wires kopf to the controller core (imported
only by ``slotctl operator``).
"""
