"""Kineto / Chrome trace reduction (HTA parity)."""
