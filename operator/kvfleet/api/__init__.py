"""Pydantic models of the custom resources; the single source of crds/*.yaml."""
