"""Megatron's indexed datasets (.bin/.idx) as document sources, and building the run's
data pipeline on them."""
