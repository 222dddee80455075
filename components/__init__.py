"""Builders the trainer plugs together; importing this registers the built-in "llama" spec
and the "fault_tolerant" container."""

from components import ft, llama  # noqa: F401  (registrations)
