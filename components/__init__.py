"""Builders the trainer plugs together; importing this registers the built-in model families
(`components.models`) and the "fault_tolerant" container."""

from components import ft, models  # noqa: F401  (registrations)
