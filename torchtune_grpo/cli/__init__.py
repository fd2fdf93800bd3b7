"""The ``tune-grpo`` command line: configs, validation, model preparation, plots, evaluation
comparison and difficulty scoring."""
