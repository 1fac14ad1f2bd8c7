"""In-job agent (placeholder until the agent lands)."""
