"""The `hpcml` command: one typer module per verb group."""
