"""Hooks into serving frameworks (each module imports its framework only when used)."""
