"""Producing completions: the generator protocol, the native KV-cache engine, vLLM, multi-turn
tool use and the counter-based seeds that make sampling reproducible."""
