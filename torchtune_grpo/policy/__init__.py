"""The policy model as the algorithm sees it: building it (plain or FSDP2-sharded), the decoder
whose output head answers each forward's request (last-position logits, response log-probs,
packed micro-batches), those forward passes, and memory-bounded log-prob kernels."""
