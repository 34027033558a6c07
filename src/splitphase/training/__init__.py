"""Pretraining and evaluation."""
