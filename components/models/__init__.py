"""Model families of this repository, each imported (and so registered) by
`components.train_spec.get_train_spec` when first asked for (`BUILTINS` there)."""
