"""Launching rank processes (cpu / cuda / shared-gpu), the worker loop, timeouts, env hygiene."""
