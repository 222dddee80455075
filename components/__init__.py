"""Generic builders the trainer plugs together: optimizer registry, job builder, checkpoints,
LR schedules, torchft wiring, parallelize, metrics, train-spec registry, and what the
training loop does with each step's outcome (`loop`).

Model families live in `components.models` and register their train specs when
`components.train_spec.get_train_spec` is first called, so no module here imports them.
"""
