"""No draft at all: every cycle verifies the root alone, i.e. plain decoding through the speculative loop.

What a checkpoint of kind "none" loads as: the search found nothing faster than vanilla decoding on
that hardware, and says so rather than exporting a draft that slows decoding down.
"""

from __future__ import annotations

from decode.drafts.base import Draft
from decode.loop.tree import DraftTree, root_only


class NoDraft(Draft):
    name = "none"

    def start(self, target, prompt, prefill) -> None:
        pass

    def propose(self, root, policy, sampling, generator) -> DraftTree:
        return root_only(root)
