"""Durable restarts: the request journal, its replay after a restart, and the registry of resumable requests."""
