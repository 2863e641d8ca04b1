"""Acceptance rules (exact, LANTERN/LANTERN++, GSD, CASCADE), their registry and tree verification."""
from .verify import AcceptanceRule, ExactRule, LanternRule, VerifyContext, make_rule, verify_tree  # noqa: F401
