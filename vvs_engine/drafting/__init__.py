"""Drafting: the EAGLE-style draft head, draft trees, and the draft session that grows them."""
from .session import DraftSession, TreeSpec  # noqa: F401
from .tree import DraftTree, STATIC_TREES  # noqa: F401
