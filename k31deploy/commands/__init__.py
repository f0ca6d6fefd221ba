"""Subcommands of the `k31` CLI, one module per area."""
