"""Acceptance (tau) of a draft estimated from stored target data, without running the target.

The speculative loop is replayed with the target replaced by what the data already holds: the
prompt's features stand in for the prefill, and a tree is verified greedily by walking down the
children whose tokens equal the stored continuation. When that continuation is the target's own
greedy output (supernet.data --mode regenerate), this is *exactly* what greedy speculative
decoding does: same trees, same accepted paths, same features fed back (up to the storage
precision of the features). On teacher-mode data (dataset answers) it estimates acceptance along
the dataset's text instead, and a node also counts as accepted only where that text agrees with
the target's argmax.

One draft forward per tree level is the whole cost, so hundreds of archs can be scored.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from decode.drafts.neural import NeuralDraft
from decode.loop.sampling import SamplingConfig
from decode.loop.tree import TreePolicy
from decode.prompt import Prompt
from decode.targets.capture import normalize_layer
from decode.targets.target import PrefillOutput

logger = logging.getLogger(__name__)
GREEDY = SamplingConfig()


@dataclass
class Acceptance:
    tau: float  # tokens emitted per verify (bonus included), prefill token excluded, as SpecResult.tau
    cycles: int
    emitted: int
    hist: dict[int, int] = field(default_factory=dict)


def _walk(tree, cont: list[int], depth0: int) -> list[int]:
    """Greedy acceptance against a known continuation: cont[d] is the token expected at depth d (d >= 1)."""
    tokens = tree.tokens.tolist()
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    path, node, d = [0], 0, depth0
    while d + 1 < len(cont):
        nxt = next((c for c in kids.get(node, []) if tokens[c] == cont[d + 1]), None)
        if nxt is None:
            break
        path.append(nxt)
        node, d = nxt, d + 1
    return path


def start_replay(draft: NeuralDraft, seq: dict, prompt_len: int, num_layers: int
                 ) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Start `draft` on the stored prompt of `seq` as a prefill would; -> (features {layer: (T, H)} on the
    draft's device, cont (T,): the token a node at position j must equal to be accepted, -1 for none).

    A node at position j is accepted when it equals the stored token there AND the target's argmax after
    j-1 (always true on regenerated data; on teacher data the two can differ).
    """
    ids = seq["input_ids"].tolist()
    p = prompt_len
    dev = draft.model.feat_fc.weight.device
    hidden = {x: seq["hidden"][normalize_layer(x, num_layers)].to(dev) for x in draft.feature_layers}
    argmax = seq["topk_ids"][:, 0].tolist()
    cont = [ids[j] if j == 0 or argmax[j - 1] == ids[j] else -1 for j in range(len(ids))]
    pre = PrefillOutput(logits=torch.empty(0), hidden={x: h[:p] for x, h in hidden.items()},
                        image_positions=seq["image_mask"][:p].nonzero().flatten(),
                        attn_received=seq["attn_received"][:p].float())
    draft.start(None, Prompt(input_ids=seq["input_ids"][:p][None]), pre)
    return hidden, cont


@torch.no_grad()
def replay_sequence(draft: NeuralDraft, seq: dict, prompt_len: int, num_layers: int, policy: TreePolicy,
                    max_new_tokens: int | None = None) -> tuple[int, int, Counter]:
    """(emitted tokens, cycles, accepted-length histogram) of greedy speculative decoding on one sequence.

    seq: a FeatureData item (input_ids (T,), hidden {layer: (T, H)}, topk_ids (T, K), image_mask,
    attn_received); positions >= prompt_len are the continuation the target produced.
    """
    ids = seq["input_ids"].tolist()
    t = len(ids)
    p = prompt_len
    limit = t - p if max_new_tokens is None else min(max_new_tokens, t - p)
    if limit < 1:
        return 0, 0, Counter()
    hidden, cont = start_replay(draft, seq, p, num_layers)
    root_pos, emitted, cycles, hist = p, 1, 0, Counter()
    while emitted < limit:
        tree = draft.propose(ids[root_pos], policy, GREEDY, None).truncated(limit - emitted - 1)
        path = _walk(tree, cont[root_pos:], 0)
        m = len(path) - 1
        cycles += 1
        hist[m] += 1
        emitted += m + 1  # accepted draft tokens + the bonus token
        if emitted < limit:
            path_hidden = {x: h[root_pos:root_pos + m + 1] for x, h in hidden.items()}
            draft.accept(ids[root_pos:root_pos + m + 1], path_hidden, ids[root_pos + m + 1])
        root_pos += m + 1
    return min(emitted, limit), cycles, hist


def estimate_tau(draft: NeuralDraft, sequences, num_layers: int, policy: TreePolicy,
                 max_new_tokens: int | None = None) -> Acceptance:
    """Pooled tau over held-out sequences (FeatureData items): emitted tokens after the first / cycles."""
    emitted = cycles = 0
    hist: Counter = Counter()
    for seq in sequences:
        e, c, h = replay_sequence(draft, seq, int(seq["prompt_len"]), num_layers, policy, max_new_tokens)
        if c:
            emitted += e - 1
            cycles += c
            hist.update(h)
    return Acceptance(tau=emitted / cycles if cycles else 1.0, cycles=cycles, emitted=emitted, hist=dict(hist))
