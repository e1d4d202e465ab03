"""The slot manager: the single lifecycle authority. Only this package changes slot state.

``SlotManager`` (:mod:`.manager`) is a thin façade over parts, each a room of its own::

    manager        the façade: desired state, views, swaps, shutdown
    housekeeping   time-driven engines: exits, holds, idle/TTL, breakers, liveness, pressure
    recovery       adopt / finish-unload / mark-gone after a restart; restore in order
    leases         acquire (cold slots joined), release, hold — the router's surface
    loading        the load flow: wish, join, pull, start, probe, settle, fail; a wake
    admission      the one load decision on live state, the dry run, the reservation
    unloading      drain, stop, evict (revalidated: each victim slept or unloaded),
                   exclusive-group swaps
    residency      the residency tier: a victim put to sleep, a wake's calls, asking
    core           the shared seams (runtime, prober, memory, clock, events, settings)
    table          the records, views, memory sums and the one state writer
    wishes, locks  residency/pause wishes; the locks and their one order
    records        plain data: SlotRecord, SlotView, Lease, ManagerConfig

import-linter keeps that order (a part imports only the parts below it). Callers see the
façade and, for what they may call, the Protocols in :mod:`.ports`.
"""
