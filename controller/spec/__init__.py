"""Desired state: the schema, the stack loader, the config-dir reader and the write guard.

Imports nothing of the runtime, the manager or the API (checked by import-linter).
"""

from controller.spec.configdir import ConfigSnapshot, read_config_dir, read_settings
from controller.spec.guard import (
    delete_slot_config,
    guard_slot_write_payload,
    write_catalogue,
    write_slot_config,
)
from controller.spec.loader import DesiredSlot, DesiredState, LoadReport, load_stacks
from controller.spec.problems import Problem
from controller.spec.rules import check_slot_payload
from controller.spec.schema import (
    ControllerSettings,
    ModelSpec,
    ServerSpec,
    SlotSpec,
    StackMeta,
    provider_requires_model,
)

__all__ = [
    "ConfigSnapshot",
    "ControllerSettings",
    "DesiredSlot",
    "DesiredState",
    "LoadReport",
    "ModelSpec",
    "Problem",
    "ServerSpec",
    "SlotSpec",
    "StackMeta",
    "check_slot_payload",
    "delete_slot_config",
    "guard_slot_write_payload",
    "load_stacks",
    "provider_requires_model",
    "read_config_dir",
    "read_settings",
    "write_catalogue",
    "write_slot_config",
]
