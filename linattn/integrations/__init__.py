"""Integrations with model libraries; each submodule imports its library, this package none."""
