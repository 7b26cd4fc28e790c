"""Deployment helpers: the local launcher (``python -m deploy.local``) and compose files."""
