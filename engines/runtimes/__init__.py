"""Inference runtimes behind one interface (see base.Backend)."""
