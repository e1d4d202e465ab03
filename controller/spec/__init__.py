"""Desired state: the schema, the stack loader, the config-dir reader and the write guard.

Imports nothing of the runtime, the manager or the API (checked by import-linter).
"""
