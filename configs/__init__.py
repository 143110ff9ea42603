"""Preset files."""
