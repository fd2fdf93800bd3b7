"""The policy model as the algorithm sees it: building it (plain or FSDP2-sharded), its forward
passes (last-position logits, response log-probs, packed micro-batches) and memory-bounded
log-prob kernels."""
