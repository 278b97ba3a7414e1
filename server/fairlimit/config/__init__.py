"""Descriptor YAML -> the frozen core model; file discovery and reload."""
