"""Identifier types and their validation: slot names and model ids.

Pure. Slot names become directory names, container names and Kubernetes objects, so they
are DNS-1123 labels, checked before they touch any path.
"""

from __future__ import annotations

import re
from typing import Final, NewType

__all__ = [
    "MODEL_ID_PATTERN",
    "SLOT_NAME_PATTERN",
    "ModelId",
    "SlotName",
    "is_valid_slot_name",
]

SlotName = NewType("SlotName", str)
ModelId = NewType("ModelId", str)

SLOT_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_SLOT_NAME_RE: Final = re.compile(SLOT_NAME_PATTERN)
# Model ids are free-form ("qwen2.5-7b:q4", "org/repo") but never whitespace, control
# characters or quotes.
MODEL_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,199}$"


def is_valid_slot_name(name: object) -> bool:
    return isinstance(name, str) and _SLOT_NAME_RE.fullmatch(name) is not None
