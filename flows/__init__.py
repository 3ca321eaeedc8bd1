"""Prefect flows: thin tasks over the pipeline library."""
