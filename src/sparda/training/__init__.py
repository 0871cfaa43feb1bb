"""Forecast training with the base model frozen (SPEC §5)."""
