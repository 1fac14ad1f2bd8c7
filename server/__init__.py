"""FastAPI ingest/query service and the Postgres store."""
