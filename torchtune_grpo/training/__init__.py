"""Recipe plumbing: the training recipe and its asynchronous variant, config loading and
validation, settings, batching, metrics, run health, distributed helpers, checkpoints and
memory estimates."""
