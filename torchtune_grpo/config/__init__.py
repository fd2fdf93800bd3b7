"""Configs: loading (shipped names, inheritance, overrides), the schema and nested settings,
and validation of a whole config before anything is built."""
