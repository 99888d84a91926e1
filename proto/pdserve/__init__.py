"""Namespace of pdserve's generated wire-contract code (import with ``proto/`` on sys.path)."""
