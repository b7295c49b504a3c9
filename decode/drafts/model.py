"""DraftModel: the neural draft built from a DraftArch and the target's shapes; save/load.

Inputs per draft position j (aligned with the target's positions): token x_j and a feature g_j.
    concat/hybrid: g_j = feat_fc(target features of position j-1) for committed tokens, or the
                   draft's own output hidden of the parent node for tokens it drafted itself;
                   the layer input is in_fc([embed(x_j); g_j]).  (EAGLE)
    cross/hybrid:  layers cross-attend (tanh-gated) to a memory of feat_fc(target features) of
                   earlier positions.  (DREAM)
The output hidden h_j predicts x_{j+1} through norm + LM head (draft_vocab rows, d2t map).

The token embedding is the target's (shared, never saved); so is the LM head when draft_vocab is
the full vocabulary. A checkpoint is a directory with model.safetensors + draft_config.json.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from decode.arch import DraftArch
from decode.drafts.blocks import DraftKV, DraftLayer, RMSNorm
from decode.errors import UserError
from decode.runtime.small_rows import linear
from decode.targets.compat import check_fingerprint

if TYPE_CHECKING:
    from decode.targets.target import TargetModel

logger = logging.getLogger(__name__)

CONFIG_NAME = "draft_config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class TargetDims:
    """The target shapes a draft is built for."""

    hidden_size: int
    head_dim: int
    vocab_size: int
    num_layers: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def of(cls, target: "TargetModel") -> "TargetDims":
        cfg = target.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(target.hidden_size, int(head_dim), target.vocab_size, target.num_layers,
                   float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta_of(cfg))


def rope_theta_of(cfg) -> float:
    """The target's rotary base (transformers 5.x: rope_parameters, per layer type for Gemma 3), so that a draft
    started from the target's layers sees positions the way those layers were trained to."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "full_attention" in params:  # per layer type: the global layers' base
        params = params["full_attention"] or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(cfg, "rope_theta", None) or 10000.0)


class DraftModel(nn.Module):
    layer_cls: type[DraftLayer] = DraftLayer  # the supernet swaps in its elastic layer

    def __init__(self, arch: DraftArch, dims: TargetDims, d2t: torch.Tensor | None = None):
        super().__init__()
        self.arch, self.dims = arch, dims
        h = dims.hidden_size
        vd = arch.draft_vocab or dims.vocab_size
        if vd > dims.vocab_size:
            raise UserError(f"draft_vocab {vd} exceeds the target vocabulary ({dims.vocab_size})")
        for layer in arch.feature_layers:
            if not -(dims.num_layers + 1) <= layer <= dims.num_layers:
                raise UserError(f"feature layer {layer} does not exist in a {dims.num_layers}-layer target")
        self.feat_fc = nn.Linear(len(arch.feature_layers) * h, h, bias=True)
        self.in_fc = nn.Linear(2 * h, h, bias=False) if arch.uses_concat else None
        self.layers = nn.ModuleList(
            self.layer_cls(h, arch.heads[i], dims.head_dim, arch.ffn[i], arch.uses_cross, dims.rms_eps)
            for i in range(arch.depth)
        )
        self.norm = RMSNorm(h, dims.rms_eps)
        self.own_head = arch.draft_vocab is not None and arch.draft_vocab < dims.vocab_size
        self.head = nn.Linear(h, vd, bias=False) if self.own_head else None
        d2t = torch.arange(vd) if d2t is None else d2t.long()
        if d2t.shape != (vd,) or int(d2t.max()) >= dims.vocab_size or d2t.unique().numel() != vd:
            raise UserError(f"d2t must hold {vd} distinct target token ids")
        self.register_buffer("d2t", d2t, persistent=True)
        # the target's embedding and LM head, set by attach(); a tuple so that nn.Module does not
        # register them as submodules (they must not be saved, moved or trained with the draft)
        self._shared: tuple[nn.Embedding, nn.Linear] | tuple = ()

    # ------------------------------------------------------------------ wiring to a target
    def attach(self, target: "TargetModel", init_head: bool = False) -> "DraftModel":
        """Share the target's token embedding (and LM head for full vocab); move to its device/dtype.

        init_head copies the selected target LM-head rows into the draft head (fresh drafts).
        """
        if TargetDims.of(target) != self.dims:
            raise UserError(f"draft was built for target dims {self.dims}, not {TargetDims.of(target)}")
        self._shared = (target.decoder.embed_tokens, target.lm_head)
        self.to(device=target.device, dtype=target.dtype)
        if self.own_head and init_head:
            with torch.no_grad():
                self.head.weight.copy_(target.lm_head.weight[self.d2t])
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self._shared[0].weight)  # raw table (no family scaling)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) draft hidden -> (n, V_target) logits; tokens outside the draft vocab get -inf."""
        z = self.norm(hidden)
        rows = self.head_rows()
        if rows is None:
            return self._shared[1](z).float()
        weight, d2t = rows
        out = torch.full((z.shape[0], self.dims.vocab_size), -float("inf"), device=z.device)
        out[:, d2t] = linear(z, weight).float()
        return out

    def logits_at(self, hidden: torch.Tensor, token_ids: torch.Tensor, shared_ids: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """Logits of chosen tokens only: (n, H) draft hidden, (n, K) per-row target token ids and optional
        (M,) ids shared by every row -> (n, K + M) fp32 (-inf for tokens outside the draft vocab). Equals
        logits(hidden) gathered at those ids, at (K + M) / V of the head's cost: a training loss restricted
        to the target's top-k (plus shared negatives) needs no full-vocabulary matmul."""
        z = self.norm(hidden)
        rows = self.head_rows()
        if rows is None:
            weight = self._shared[1].weight

            def row_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return ids, torch.ones_like(ids, dtype=torch.bool)
        else:
            weight, d2t = rows
            t2d = torch.full((self.dims.vocab_size,), -1, dtype=torch.long, device=d2t.device)
            t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)  # target id -> draft row (-1: not drafted)

            def row_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                r = t2d[ids]
                return r.clamp_min(0), r >= 0
        rk, vk = row_of(token_ids)
        w = self.gather_head(weight, rk)  # (n, K, H)
        out = torch.einsum("nh,nkh->nk", z.to(w.dtype), w).float().masked_fill(~vk, -float("inf"))
        if shared_ids is not None and shared_ids.numel():
            rs, vs = row_of(shared_ids)
            extra = F.linear(z.to(weight.dtype), self.gather_head(weight, rs)).float().masked_fill(~vs[None, :],
                                                                                                  -float("inf"))
            out = torch.cat([out, extra], dim=1)  # (n, K + M)
        return out

    def gather_head(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids]: rows of the LM head in use (head_rows()'s, or the target's) for row ids of any shape. The
        supernet overrides it to gather from its whole hot-token head with an in-place gradient."""
        return weight[ids]

    def head_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(head weight (Vd, H), draft-to-target ids (Vd,)) of a hot-token head; None = the target's head.
        The supernet overrides it with the leading rows of its active draft_vocab."""
        return (self.head.weight, self.d2t) if self.own_head else None

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype of the draft's activations: its norms' (a draft packed for CPU decoding keeps float32 activations
        through bfloat16 linear weights, decode/drafts/pack.py)."""
        return self.norm.weight.dtype

    def project_features(self, feats: torch.Tensor) -> torch.Tensor:
        """(n, F*H) concatenated target features -> (n, H)."""
        return linear(feats.to(self.act_dtype), self.feat_fc.weight, self.feat_fc.bias)

    def add_memory(self, cache: DraftKV, mem: torch.Tensor, positions: torch.Tensor) -> None:
        """Append projected target features (m, H) at target positions (m,) to the cross memory."""
        if not self.uses_cross or mem.shape[0] == 0:
            return
        for i, layer in enumerate(self.active_layers()):
            cache.append_memory(i, layer.cross.memory_kv(mem))
        cache.append_positions(positions)

    # the parts of the network a forward uses; the supernet overrides them for its active subnet
    @property
    def uses_concat(self) -> bool:
        return self.arch.uses_concat

    @property
    def uses_cross(self) -> bool:
        return self.arch.uses_cross

    def active_layers(self) -> list[DraftLayer]:
        return list(self.layers)

    def forward(
        self,
        tokens: torch.Tensor,
        g: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        cache: DraftKV,
        mem_lag: int = 0,
    ) -> torch.Tensor:
        """Run n new positions; append their K/V to `cache`.

        tokens (n,), g (n, H) fused feature inputs (ignored by pure cross fusion), positions (n,),
        allowed (n, L + n) bool over the cache entries then the new ones. A query at position p
        cross-attends to memory entries at positions < p - mem_lag (training unrolls set mem_lag
        to mimic deeper tree levels, whose memory stops at the root). Returns hidden (n, H).
        """
        x = self.embed(tokens)
        if self.uses_concat:
            x = linear(torch.cat([x, g.to(x.dtype)], dim=-1), self.in_fc.weight)
        mem_allowed = None
        if self.uses_cross:
            mem_pos = cache.mem_pos if cache.mem_pos is not None else positions.new_zeros(0)
            mem_allowed = mem_pos[None, :] < (positions[:, None] - mem_lag)  # (n, m) only earlier features
        for i, layer in enumerate(self.active_layers()):
            mem_kv = None
            if self.uses_cross:
                mem_kv = cache.mem_kv[i]
                if mem_kv is None:
                    empty = x.new_zeros(layer.cross.heads, 0, layer.cross.head_dim)
                    mem_kv = (empty, empty)
            x, kv = layer(x, positions, allowed, cache.kv[i], self.dims.rope_theta, mem_kv, mem_allowed)
            cache.append(i, kv)
        return x

    def new_cache(self) -> DraftKV:
        return DraftKV(len(self.layers))

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, directory: str | Path, target: "TargetModel", metadata: dict | None = None,
                        extra: dict | None = None) -> Path:
        """model.safetensors + draft_config.json; `extra` adds top-level config keys (a draft kind, lookup settings)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME))
        config = {
            "format": "vlm-draft-nas/draft-v1",
            "arch": self.arch.to_dict(),
            "dims": asdict(self.dims),
            "tree": asdict(self.arch.tree),
            "target": target.fingerprint().to_dict(),
            "target_name": target.name,
            "metadata": metadata or {},
            **(extra or {}),
        }
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: "TargetModel") -> "DraftModel":
        path = Path(directory)
        cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not cfg_file.is_file() or not weights.is_file():
            raise UserError(f"'{directory}' is not a draft checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        try:
            config = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{cfg_file} is not valid JSON ({err.__class__.__name__}); re-export the draft") from None
        missing = [k for k in ("arch", "dims", "target") if not isinstance(config, dict) or k not in config]
        if missing:
            raise UserError(f"{cfg_file} is not a draft config (missing {', '.join(missing)}); re-export the draft")
        wrong = [k for k in ("arch", "dims", "target") if not isinstance(config[k], dict)]
        if wrong:
            raise UserError(f"{cfg_file}: {', '.join(repr(k) for k in wrong)} must be JSON objects; re-export the draft")
        diff = check_fingerprint(config["target"], target.fingerprint().to_dict(), f"draft '{directory}'")
        if diff:
            raise UserError(f"draft '{directory}' was made for target '{config.get('target_name')}', "
                            f"not '{target.name}' ({diff}; draft vs target); pass the matching --target")
        try:
            arch, dims = DraftArch.from_dict(config["arch"]), TargetDims(**config["dims"])
        except (TypeError, ValueError, AttributeError, UserError) as err:
            raise UserError(f"{cfg_file}: bad arch or dims ({err}); re-export the draft") from None
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{weights} is not a readable safetensors file ({str(err).splitlines()[0][:120]}); "
                            "re-export the draft") from None
        model = cls(arch, dims, d2t=state.get("d2t"))
        try:
            model.load_state_dict(state, strict=True)  # strict: any missing or extra tensor is an error
        except RuntimeError as err:
            raise UserError(f"draft '{directory}' weights do not match its draft_config.json: {str(err).splitlines()[0]}") from None
        model.metadata = config.get("metadata", {})
        return model.attach(target).eval()
