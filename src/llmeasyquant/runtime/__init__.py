"""Inference paths beyond transformers' own forward."""
