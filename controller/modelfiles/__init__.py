"""Model files on disk: pull, verify, cache (docs/models.md, docs/design/0018).

The adapters row of the house: the disk and the network for model files. A model's
source (``hf://org/repo/file``, ``hf://org/repo``, ``https://…``, a path) becomes verified
files in the models dir through :class:`controller.modelfiles.pull.ModelFiles`, the one
façade the slot manager, the CLI and the API call. Imports the vocabulary, the kit, the
stack schema and the store; never the slot manager, the runtimes or the API.
"""
