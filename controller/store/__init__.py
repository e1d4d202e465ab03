"""Observed-state persistence: atomic files under the state dir (and residency.json).

The only package that writes state files: ``files`` the atomic writers and the sweep of
their temp files; ``state`` each slot's ``state.json`` and aux files; ``residency``
``residency.json``; ``lock`` one controller per state dir, its record and the API token;
``runinfo`` which controller runs on a state dir.
Every write goes through :func:`atomic_write_bytes`:
a temp file in the same directory, fsync, ``os.replace``, then fsync of the directory, so
a reader (or a controller restarted after SIGKILL) sees the old file or the new one, never
a torn one. Slot names are validated before they become part of a path. A state write the
filesystem refuses (ENOSPC, EROFS, EIO) is :class:`~controller.model.errors.StateWriteFailed`,
naming the path and the errno; the old file stays.
"""
