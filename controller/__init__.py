"""slotctl: keeps local model-serving slots converged with what their owner declared.

The import package is ``controller``; the console script is ``slotctl``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
