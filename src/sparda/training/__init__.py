"""Forecast training with the base model frozen (design §5)."""
