"""Outer parts: what follows each committed step, with state of its own (`containers.parts.Outer`).

`DiLoCo` (`diloco`): local inner steps, an outer step on the averaged pseudo-gradient every
`sync_steps`, its outer state container state; it refuses a replica group whose settings differ
from the others' with `SettingsMismatch` (`containers.quorum`).
"""

from containers.outer.diloco import DiLoCo

__all__ = ["DiLoCo"]
