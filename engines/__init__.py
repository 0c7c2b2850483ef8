"""Device fingerprint, engine store, build, precision and runtimes.

Imports nothing of agent/ or pipelines/ (imports flow agent -> pipelines -> engines).
"""
