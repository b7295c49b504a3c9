"""LatencyModel: predicted cycle latency of any DraftArch from a hardware profile (measured or predicted).

One speculative cycle (decode.loop.speculative) of a NeuralDraft with a dynamic (EAGLE-2) tree:

    level 0      one draft forward over w0 = accepted tokens (pending accepted drafts + the root):
                 feat_fc(f, w0) + draft_input(w0) + depth x draft_layer(w0) + lm_head(1 row) + scorer(1)
    levels 1..   tree_depth - 1 forwards over top_k frontier nodes each (build_tree expands the
                 top_k best nodes per level; the last level's candidates are not fed):
                 draft_input(k) + depth x draft_layer(k) + lm_head(k) + scorer(k)
    verify       the target scores total_tokens + 1 tokens (root included) in one forward
    accept       feat_fc(f, accepted rows) + per cross layer memory_append
    overhead     Python and bookkeeping of propose/accept beyond these components (measured)

cycle_ms = draft_cycle_ms + verify_ms(tree tokens) + overhead_ms. Every lookup interpolates the
profile's tables linearly (hwprofile.tables), so grid points come back exactly. `accepted` is the
expected tau (tokens emitted per cycle, bonus included), which sets the level-0 and accept widths.
"""

from __future__ import annotations

from pathlib import Path

from decode.arch import DraftArch, max_tree_nodes
from hwprofile.bench_draft import head_vocab
from hwprofile.schema import Profile


def tree_tokens(arch: DraftArch) -> int:
    """Tokens the target verifies: the draft nodes an EAGLE-2 tree can hold (at most total_tokens) + the root."""
    return min(arch.total_tokens, max_tree_nodes(arch.tree_depth, arch.top_k)) + 1


class LatencyModel:
    def __init__(self, profile: Profile):
        profile.check_tables()
        self.profile = profile
        self.tables = profile.tables
        self.vocab_size = int(profile.target["vocab_size"])
        self.default_context = int(profile.grids["default_context"])

    @classmethod
    def load(cls, path: str | Path) -> "LatencyModel":
        return cls(Profile.load(path))

    @property
    def predicted(self) -> bool:
        return self.profile.predicted

    def _ctx(self, context: float | None) -> float:
        return float(self.default_context if context is None else context)

    # ------------------------------------------------------------------ target
    def prefill_ms(self, context: float) -> float:
        return self.tables["target_prefill"].lookup(ctx=context)

    def target_step_ms(self, context: float | None = None) -> float:
        """One vanilla decode step at this many committed tokens."""
        return self.tables["target_step"].lookup(ctx=self._ctx(context))

    def verify_ms(self, n_tokens: float, context: float | None = None) -> float:
        """Verify n_tokens tree tokens (root included) after `context` committed tokens."""
        return self.tables["verify"].lookup(n=n_tokens, ctx=self._ctx(context))

    # ------------------------------------------------------------------ draft
    def draft_context(self, arch: DraftArch, context: float | None = None, image_tokens: int = 0) -> float:
        """Positions the draft attends to: the target's context minus the image tokens it drops."""
        return max(1.0, self._ctx(context) - image_tokens * (1.0 - arch.visual_keep))

    def forward_ms(self, arch: DraftArch, width: float, head_rows: float, context: float, level0: bool) -> dict[str, float]:
        """Components of one draft forward over `width` tokens whose last `head_rows` go through the head."""
        t = self.tables
        cross = int(arch.uses_cross)
        out = {
            "feat_fc": t["feat_fc"].lookup(f=len(arch.feature_layers), n=width) if level0 else 0.0,
            "input": t["draft_input"].lookup(concat=int(arch.uses_concat), n=width),
            "layers": sum(t["draft_layer"].lookup(heads=h, ffn=f, cross=cross, n=width, ctx=context)
                          for h, f in zip(arch.heads, arch.ffn)),
            "lm_head": t["lm_head"].lookup(vocab=head_vocab(arch.draft_vocab, self.vocab_size), n=head_rows),
            "scorer": t["scorer"].lookup(n=head_rows) if "scorer" in t else 0.0,  # optional (schema.OPTIONAL_TABLES)
        }
        return out

    def draft_breakdown(self, arch: DraftArch, accepted: float = 1.0, context: float | None = None,
                        image_tokens: int = 0) -> dict[str, float]:
        """Draft-side milliseconds per cycle by component (no overhead)."""
        ctx = self.draft_context(arch, context, image_tokens)
        w0 = max(1.0, float(accepted))  # pending accepted drafts + the root, fed in one forward
        parts = self.forward_ms(arch, w0, 1.0, ctx, level0=True)  # level 0 scores the root only
        for _ in range(arch.tree_depth - 1):  # later levels: the top_k best frontier nodes
            for name, ms in self.forward_ms(arch, arch.top_k, arch.top_k, ctx, level0=False).items():
                parts[name] += ms
        accept = self.tables["feat_fc"].lookup(f=len(arch.feature_layers), n=w0)  # project the path's features
        if arch.uses_cross:
            accept += sum(self.tables["memory_append"].lookup(heads=h, ctx=ctx) for h in arch.heads)
        parts["accept"] = accept
        return parts

    def draft_cycle_ms(self, arch: DraftArch, accepted: float = 1.0, context: float | None = None,
                       image_tokens: int = 0) -> float:
        """Draft time per cycle: propose's forwards + accept (bookkeeping overhead not included)."""
        return sum(self.draft_breakdown(arch, accepted, context, image_tokens).values())

    def overhead_ms(self, arch: DraftArch) -> float:
        return self.tables["overhead"].lookup(tree_depth=arch.tree_depth, top_k=arch.top_k)

    # ------------------------------------------------------------------ whole cycle
    def breakdown(self, arch: DraftArch, accepted: float = 1.0, context: float | None = None,
                  image_tokens: int = 0) -> dict[str, float]:
        parts = self.draft_breakdown(arch, accepted, context, image_tokens)
        parts["verify"] = self.verify_ms(tree_tokens(arch), context)
        parts["overhead"] = self.overhead_ms(arch)
        parts["total"] = sum(parts.values())
        return parts

    def cycle_ms(self, arch: DraftArch, accepted: float = 1.0, context: float | None = None,
                 image_tokens: int = 0) -> float:
        """Draft cycle + verify(total_tokens + 1) + overhead."""
        return self.breakdown(arch, accepted, context, image_tokens)["total"]

    def speedup(self, arch: DraftArch, tau: float, context: float | None = None, image_tokens: int = 0) -> float:
        """tau * T_step / T_cycle: the speculative speed-up over vanilla decoding at this context."""
        return tau * self.target_step_ms(context) / self.cycle_ms(arch, tau, context, image_tokens)
