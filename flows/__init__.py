"""Prefect flows and deployments (train, step, rerun). Importable without torch."""
