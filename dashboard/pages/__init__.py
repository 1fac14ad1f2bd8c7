"""Dashboard pages."""
