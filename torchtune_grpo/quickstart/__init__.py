"""The CPU quickstart: a tiny Llama model and byte-level tokenizer written as an HF folder,
warmed up so that GRPO has something to learn (tools, not part of the training library)."""
