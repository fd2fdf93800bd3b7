"""The training recipe and its asynchronous variant, with the parts they compose: setup, the
update, prompt batching, metrics, run health and interrupts."""
