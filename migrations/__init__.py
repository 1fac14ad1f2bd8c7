"""Alembic migrations of the fleetscope schema (applied by `fleetscope db upgrade` / `serve`)."""
