"""Helpers shared by the test areas: inputs, float64 references, masks, cache scripts."""
