"""Model families, each registered by its entry point in `optimizer_containers.train_specs`
(pyproject.toml) when `components.train_spec.get_train_spec` first asks for it."""
