"""``slotctl up``: the controller in the foreground, in three parts.

- ``daemon.main``: start-up and shutdown wiring: preflight, the composition root, the
  API servers, signals, progress lines, the drain-then-stop shutdown; ``stop_everything``
  for ``slotctl down`` without a controller.
- ``daemon.supervise``: every background task under a supervisor that reports and
  restarts it (fault containment, docs/reliability.md).
- ``daemon.watch`` and ``daemon.gitops``: following the config dir (and the stack dir)
  with watchfiles, and validating and applying the stack dir in GitOps mode.

Layers (``.importlinter``): main above watch and gitops and supervise, which import each
other not at all.
"""
