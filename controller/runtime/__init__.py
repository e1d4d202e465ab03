"""Runtimes: the one seam between the slot manager and processes / containers / pods.

``base`` defines the protocol; ``process`` (default), ``docker``, ``kubernetes`` (a
Deployment per slot) and ``fake`` implement it.
"""
