"""Chaos drills (``rtx chaos``): faults injected into a live ``rtx serve`` under load, and what must survive them."""
