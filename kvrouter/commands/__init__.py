"""CLI commands, one module per command group, registered in ``kvrouter.cli``."""
