"""Runtimes: the one seam between the slot manager and processes / containers / pods.

``base`` defines the protocol; ``process`` (default), ``docker`` and ``fake`` implement it.
"""
