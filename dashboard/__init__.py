"""Dash frontend (see pages/)."""
