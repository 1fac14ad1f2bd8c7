"""fleetscope: performance observability for distributed training fleets.

The core package holds what the parts share (CLI, settings, wire format). It imports nothing heavy:
``fleetscope.agent`` runs inside training jobs.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
