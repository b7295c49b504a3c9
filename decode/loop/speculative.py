"""The speculative loop: prefill, then cycles of draft -> verify -> accept until EOS or the limit.

Each cycle: the draft proposes a tree rooted at the last emitted token, the target scores the
whole tree in one forward, `verify` picks the accepted path and a bonus token (lossless: see
decode/loop/verify.py), the target keeps that path in its cache, and the draft is told the outcome.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from decode.drafts.base import Draft
from decode.loop.sampling import SamplingConfig, make_generator, sample_token
from decode.loop.tree import DraftTree, TreePolicy
from decode.loop.vanilla import GenerationResult, check_max_new_tokens, sync_device
from decode.loop.verify import Verdict, verify
from decode.prompt import Prompt
from decode.runtime.compiled import bucket
from decode.targets.target import TargetModel


@dataclass
class SpecResult(GenerationResult):
    cycles: int = 0
    draft_s: float = 0.0  # time in draft.propose / draft.accept
    verify_s: float = 0.0  # time in target.forward_tree + verify + keep
    accept_hist: dict[int, int] = field(default_factory=dict)  # drafted tokens accepted per cycle -> count
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens emitted per target verify forward (bonus included); the prefill token is not counted."""
        return (self.new_tokens - 1) / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(tau=self.tau, accept_hist={str(k): v for k, v in sorted(self.accept_hist.items())})
        return d


def verify_cycle(target: TargetModel, tree: DraftTree, feature_layers: tuple[int, ...], sampling: SamplingConfig,
                 generator: torch.Generator | None) -> tuple[Verdict, dict[int, torch.Tensor]]:
    """A cycle's verify half: score the tree in one target forward, pick the accepted path, keep it in the target's
    cache -> (the verdict, the target's features at the path {layer: (m, H)}). Greedy reads the device once."""
    out = target.forward_tree(tree.tokens, tree_mask=tree.mask, feature_layers=feature_layers)
    verdict = verify(tree, out.logits, sampling, generator)
    target.keep(verdict.path, checked=False)  # a path verify just walked: no need to read the mask back
    return verdict, {k: v[verdict.path] for k, v in out.hidden.items()}


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    draft: Draft,
    prompt: Prompt,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    policy: TreePolicy | None = None,
) -> SpecResult:
    check_max_new_tokens(max_new_tokens, target, prompt)
    policy = policy or TreePolicy(spec=draft.default_tree)
    gen = make_generator(sampling, target.device)
    eos = target.eos_token_ids
    sync_device(target.device)  # GPU work queued before this call must not be timed as this prefill
    t0 = time.perf_counter()
    pre = target.prefill(prompt, feature_layers=draft.feature_layers, attention_stats=draft.prefill_stats(prompt),
                         reserve=max_new_tokens + bucket(draft.max_nodes(policy), target.device.type))
    root = sample_token(pre.logits[-1], sampling, gen)
    sync_device(target.device)
    t1 = time.perf_counter()
    tokens = [root]
    draft_s = verify_s = 0.0
    hist: Counter[int] = Counter()
    sizes: list[int] = []
    td = time.perf_counter()
    draft.start(target, prompt, pre)
    sync_device(target.device)  # the draft's prompt features are its own work, not the first cycle's
    draft_s += time.perf_counter() - td
    while len(tokens) < max_new_tokens and root not in eos:
        td = time.perf_counter()
        # never draft deeper than we may still emit: accepted + bonus <= remaining
        tree = draft.propose(root, policy, sampling, gen).truncated(max_new_tokens - len(tokens) - 1)
        sync_device(target.device)
        tv = time.perf_counter()
        verdict, path_hidden = verify_cycle(target, tree, draft.feature_layers, sampling, gen)
        sync_device(target.device)
        td2 = time.perf_counter()
        path_tokens, bonus = verdict.tokens, verdict.bonus
        new = path_tokens[1:] + [bonus]
        for i, tok in enumerate(new):  # stop right after an EOS, as vanilla decoding does
            if tok in eos:
                new = new[: i + 1]
                break
        tokens.extend(new)
        hist[len(path_tokens) - 1] += 1
        sizes.append(tree.size)
        root = new[-1]
        if root not in eos and len(tokens) < max_new_tokens:
            draft.accept(path_tokens, path_hidden, bonus)
        sync_device(target.device)
        t_end = time.perf_counter()
        draft_s += (tv - td) + (t_end - td2)
        verify_s += td2 - tv
    sync_device(target.device)
    t2 = time.perf_counter()
    tokens = tokens[:max_new_tokens]
    return SpecResult(
        tokens=tokens, text=target.tokenizer.decode(tokens, skip_special_tokens=True),
        prefill_s=t1 - t0, decode_s=t2 - t1, target_forwards=len(sizes),
        cycles=len(sizes), draft_s=draft_s, verify_s=verify_s, accept_hist=dict(hist), tree_sizes=sizes,
    )
