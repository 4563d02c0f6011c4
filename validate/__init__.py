"""Validation: baseline-vs-converted inference, parity metrics, certificate, model card.

Kept free of imports: the package imports this eagerly, and torch loads only when used.
"""
