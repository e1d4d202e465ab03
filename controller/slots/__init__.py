"""The slot manager: the single lifecycle authority. Only this package changes slot state.

``SlotManager`` (:mod:`.manager`) is a thin façade over parts, each a room of its own::

    manager        the façade: desired state, views, swaps, shutdown
    housekeeping   time-driven engines: exits, holds, idle/TTL, breakers, liveness, pressure
    recovery       adopt / finish-unload / mark-gone after a restart; restore in order
    leases         acquire (cold slots joined), release, hold — the router's surface
    surge          surge rollouts: the second server, the switch, the drain
    loading        the load flow: wish, join, pull, start, probe, settle, fail; a wake
    units          a co-loaded unit's one load task, rollback and dry run
    admission      the one load decision on live state and the one admit loop (decide,
                   make room, decide again, reserve) for a load, a wake, a landed pod
    unloading      drain, stop, evict (revalidated: each victim slept or unloaded),
                   exclusive-group swaps
    residency      the residency tier: a victim put to sleep, a wake's calls, asking
    core           the shared seams (runtime, prober, memory, clock, events, settings)
    table          the one writer of every fact of a record (its state first), views,
                   memory sums (usage)
    wishes, locks  residency/pause wishes; the locks and their one order
    interfaces     what each caller may call (Protocols)
    dryrun         the dry run of a load as data (LoadPlan)
    records        the record (facts; the running server, one frozen value), views
    flight         loading's coordination of a slot: the load task, admission, generation
    leasebook      leasing's: the leases, the waiting requests, the drain gate

A record is written by its owners only (docs/design/0016: the table for its facts and its
server, loading and leasing for their coordination objects; tests/unit/test_record_owners.py
checks it). import-linter keeps the order above (a part imports only the parts below it).
Callers see the façade and, for what they may call, the Protocols in :mod:`.interfaces`.
"""
