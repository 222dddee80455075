"""Builders the trainer plugs together; importing this registers the "fault_tolerant" container.

The built-in model families (`components.models`) register their train specs when
`components.train_spec.get_train_spec` is first called, so no module here imports them.
"""

from components import ft  # noqa: F401  (registration)
