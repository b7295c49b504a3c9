"""supernet.train: the sandwich rule learns, resume is exact, torchrun (gloo, 2 processes) works."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import single_thread, tiny_target
from safetensors.torch import load_file

from decode.drafts.model import TargetDims
from decode.errors import UserError
from decode.space import SearchSpace
from supernet import checkpoint as ckpt
from supernet.data import DataConfig, build_data
from supernet.dataset import FeatureData
from supernet.elastic import DraftSupernet
from supernet.train import TrainConfig, evaluate, train
from supernet.unroll import LossConfig, subnet_losses, unroll_mask

TARGET = "tiny-llava"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sn") / "data"
    with single_thread():
        build_data(DataConfig(target=TARGET, prompts="sharegpt:10,images:2", space="tiny", max_len=96, topk=16,
                              image_answer_tokens=8, shard_size=4, out=str(out)), target=tiny_target(TARGET))
    return out


def _cfg(data_dir, out, **kw) -> TrainConfig:
    base = dict(target=TARGET, data=str(data_dir), out=str(out), space="tiny", steps=6, lr=3e-3, warmup=2,
                unroll=2, n_random=1, ckpt_every=3, reorder_at=4, val_sequences=2, device="cpu", dtype="float32",
                # the tiny byte-level tokenizer leaves short answers in 96 tokens: score every position
                answer_only=False)
    return TrainConfig(**{**base, **kw})


def _losses(out) -> list[tuple[str, str, str]]:
    with open(out / "train_log.csv") as f:
        return [(r["step"], r["role"], r["loss"]) for r in csv.DictReader(f)]


def test_unroll_mask_sees_root_prefix_and_ancestors():
    m = unroll_mask(5, 2, torch.device("cpu"))  # (5, 15): step-0, step-1, step-2 entries
    p = 4  # query at position 4, root at 2
    assert m[p, :5].tolist() == [True, True, True, False, False]
    assert m[p, 5:10].tolist() == [False, False, False, True, False]  # step-1 entry at position 3
    assert m[p, 10:].tolist() == [False, False, False, False, True]  # itself


def test_answer_only_scores_answer_positions(data_dir):
    target = tiny_target(TARGET)
    data = FeatureData(data_dir, target)
    model = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), data.entropy_layer,
                          data.hot_tokens(128)).attach(target).float()
    seq = next(data[i] for i in range(len(data)) if data[i]["input_ids"].numel() > int(data[i]["prompt_len"]) + 2)
    _, all_pos = subnet_losses(model, seq, LossConfig(unroll=1, answer_only=False))
    _, answers = subnet_losses(model, seq, LossConfig(unroll=1, answer_only=True))
    assert answers["kl0"] != all_pos["kl0"]
    prompt_only = {**seq, "prompt_len": torch.tensor(seq["input_ids"].numel() + 1)}
    _, none = subnet_losses(model, prompt_only, LossConfig(unroll=1, answer_only=True))
    assert "kl0" not in none  # nothing to score when every position is prompt


def test_weight_parts_add_the_gradient_autograd_computes(data_dir, monkeypatch):
    """supernet.grad_slices: the sliced q/k/v/o and FFN weights, feat_fc's column blocks, the hot-token head's
    leading rows and its candidate rows add their gradient into .grad in place; over a sandwich of subnets (every
    fusion kind, both losses, two sequences) the gradients equal plain autograd slicing's, and the in-place backward
    really ran."""
    import supernet.elastic as elastic
    from supernet import grad_slices

    target = tiny_target(TARGET)
    data = FeatureData(data_dir, target)
    space = SearchSpace.load("tiny")
    rng = __import__("random").Random(3)
    archs = [space.largest(data.entropy_layer), space.smallest(data.entropy_layer)]
    archs += [space.sample(rng, data.entropy_layer) for _ in range(6)]
    assert {a.fusion for a in archs} == {"concat", "cross", "hybrid"}
    assert {a.draft_vocab for a in archs} >= {64, None}
    negatives = data.hot_tokens(32)
    calls: list[str] = []
    backward = grad_slices._Into.backward
    monkeypatch.setattr(grad_slices._Into, "backward", staticmethod(
        lambda ctx, g: calls.append("slice" if isinstance(ctx.index[0], slice) else f"dim{ctx.index[0]}")
        or backward(ctx, g)))

    def grads(part) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(elastic, "part", part)
        torch.manual_seed(0)
        net = DraftSupernet(space, TargetDims.of(target), data.entropy_layer, data.hot_tokens(128))
        net = net.attach(target, init_head=True).float()
        for k, arch in enumerate(archs):
            net.set_active(arch)
            cfg = LossConfig(unroll=2, loss="topk" if k % 2 else "full", full_positions=4, feat_weight=1.0,
                             answer_only=False)
            for i in (0, 1):
                loss, _ = subnet_losses(net, data[i], cfg, seed=k, negatives=negatives)
                loss.backward()
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    def plain(weight, index):
        if isinstance(index[0], slice):
            return weight[index]
        dim, ids = index
        return weight[ids] if dim == 0 else weight[:, ids.to(weight.device)]

    want = grads(plain)
    assert not calls
    got = grads(grad_slices.part)
    assert calls.count("slice") > 20 and calls.count("dim0") > 4 and calls.count("dim1") > 4
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # outside training: the plain slice, no autograd node
        w = torch.nn.Parameter(torch.randn(6, 4))
        assert grad_slices.part(w, (slice(0, 3),)).grad_fn is None
    assert torch.equal(grad_slices.part(w, (1, torch.tensor([2, 0]))), w[:, [2, 0]])
    ids = torch.tensor([[5, 1], [0, 0]])
    assert torch.equal(grad_slices.part(w, (0, ids)), w[ids])


def test_sandwich_training_learns(data_dir, tmp_path):
    target = tiny_target(TARGET)
    data = FeatureData(data_dir, target)
    cfg = _cfg(data_dir, tmp_path / "run", steps=250, ckpt_every=250, reorder_at=30, val_sequences=0, lr=5e-3)
    torch.manual_seed(0)
    fresh = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), data.entropy_layer,
                          data.hot_tokens(128)).attach(target, init_head=True).float()
    ids = list(range(len(data)))[:6]
    before = evaluate(fresh, data, ids, LossConfig(unroll=2, answer_only=False))
    train(cfg)
    trained = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), data.entropy_layer,
                            data.hot_tokens(128)).attach(target).float()
    ckpt.load_weights(tmp_path / "run" / "checkpoint", trained)
    after = evaluate(trained, data, ids, LossConfig(unroll=2, answer_only=False))
    for role in ("largest", "smallest"):
        assert after[role]["kl0"] < 0.7 * before[role]["kl0"], (role, before[role], after[role])


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_resume_continues_exactly(data_dir, tmp_path, amp):
    train(_cfg(data_dir, tmp_path / "straight", autocast=amp))
    train(_cfg(data_dir, tmp_path / "split", steps=3, autocast=amp))
    train(_cfg(data_dir, tmp_path / "split", resume=True, autocast=amp))
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "split")
    a = load_file(str(tmp_path / "straight" / "checkpoint" / ckpt.MODEL))
    b = load_file(str(tmp_path / "split" / "checkpoint" / ckpt.MODEL))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_autocast_trains_what_fp32_trains_with_fp32_weights(data_dir, tmp_path):
    train(_cfg(data_dir, tmp_path / "fp32", autocast="off"))
    train(_cfg(data_dir, tmp_path / "bf16", autocast="bf16"))
    fp32, bf16 = _losses(tmp_path / "fp32"), _losses(tmp_path / "bf16")
    assert [r[:2] for r in fp32] == [r[:2] for r in bf16]  # the same steps and subnets
    a, b = [float(r[2]) for r in fp32], [float(r[2]) for r in bf16]
    assert a != b, "autocast=bf16 computed exactly what fp32 did: the forward is not autocast"
    assert all(abs(x - y) <= 0.03 * abs(x) for x, y in zip(a, b)), (a, b)
    w = load_file(str(tmp_path / "bf16" / "checkpoint" / ckpt.MODEL))
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in w.values() if t.is_floating_point())


def test_autocast_auto_follows_the_hardware(monkeypatch):
    from supernet import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_isa", lambda: "avx2,avx512f")
    assert precision.autocast_dtype("auto", cpu) is None  # no bf16 units: emulated bf16 gains nothing
    assert precision.autocast_dtype("bf16", cpu) == torch.bfloat16
    for isa in ("avx2,avx512f,avx512_bf16", "avx2,avx512f,amx_tile"):
        monkeypatch.setattr(precision, "cpu_isa", lambda isa=isa: isa)
        assert precision.autocast_dtype("auto", cpu) == torch.bfloat16
        assert precision.autocast_dtype("off", cpu) is None
    assert precision.autocast_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="autocast mode"):
        precision.autocast_dtype("fp8", cpu)


def test_resume_with_another_space_or_target_fails(data_dir, tmp_path):
    train(_cfg(data_dir, tmp_path / "r", steps=1, ckpt_every=1))
    with pytest.raises(UserError, match="another search space"):
        train(_cfg(data_dir, tmp_path / "r", space="default", resume=True))
    with pytest.raises(UserError, match="no supernet checkpoint"):
        train(_cfg(data_dir, tmp_path / "none", resume=True))
    with pytest.raises(UserError):
        train(_cfg(data_dir, tmp_path / "x", target="tiny-llama"))  # data made for tiny-llava


def test_torchrun_two_processes(data_dir, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517",
           "-m", "supernet.train", "--target", TARGET, "--data", str(data_dir), "--space", "tiny", "--steps", "2",
           "--ckpt-every", "2", "--unroll", "1", "--n-random", "1", "--eagle-role", "off", "--val-sequences", "0",
           "--out", str(out), "--device", "cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    state = json.loads((out / "checkpoint" / ckpt.STATE).read_text())
    assert state["step"] == 2 and state["format"] == "vlm-draft-nas/supernet-v1"
    target = tiny_target(TARGET)
    model = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), state["entropy_layer"],
                          FeatureData(data_dir).hot_tokens(128)).attach(target)
    ckpt.load_weights(out / "checkpoint", model)  # same format as a single-process checkpoint
    rows = list(csv.DictReader(open(out / "train_log.csv")))
    assert len(rows) == 2 * 3  # 2 steps x (largest, smallest, 1 random), logged once (rank 0)


@pytest.mark.parametrize("left", ["tmp", "old"])
def test_resume_after_a_save_killed_between_its_renames(data_dir, tmp_path, left):
    """A kill between `checkpoint -> checkpoint.old` and `checkpoint.tmp -> checkpoint` leaves no checkpoint;
    resuming takes the complete .tmp (the newer save) or, without one, .old."""
    import os

    train(_cfg(data_dir, tmp_path / "straight"))
    train(_cfg(data_dir, tmp_path / "split", steps=3))
    ck = tmp_path / "split" / "checkpoint"
    os.replace(ck, ck.with_name("checkpoint." + left))  # what the kill leaves behind
    train(_cfg(data_dir, tmp_path / "split", resume=True))
    assert ck.is_dir() and not ck.with_name("checkpoint." + left).exists()
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "split")


def _copy_data(data_dir, dest):
    import shutil

    shutil.copytree(data_dir, dest)
    return dest


def test_nan_data_and_damaged_shards_are_refused(data_dir, tmp_path):
    from safetensors.torch import save_file

    bad = _copy_data(data_dir, tmp_path / "nan")
    shard = sorted(bad.glob("shard-*.safetensors"))[0]
    tensors = load_file(str(shard))
    key = next(k for k in tensors if k.startswith("hidden."))
    tensors[key][0, 0] = float("nan")  # a valid header, a NaN payload
    save_file(tensors, str(shard))
    with pytest.raises(UserError, match="non-finite"):
        train(_cfg(bad, tmp_path / "o1", steps=3))
    assert not (tmp_path / "o1" / "checkpoint").exists()
    for name, damage in (("trunc", lambda p: p.write_bytes(p.read_bytes()[:200])), ("gone", lambda p: p.unlink())):
        d = _copy_data(data_dir, tmp_path / name)
        damage(sorted(d.glob("shard-*.safetensors"))[0])
        with pytest.raises(UserError, match="shard"):
            train(_cfg(d, tmp_path / f"o-{name}", steps=3))


def test_sequences_are_read_one_at_a_time_in_any_order(data_dir, tmp_path):
    """FeatureData reads one sequence's rows (not its whole shard) and returns exactly the stored rows in any order;
    the first read from a shard still checks the whole shard, so NaN in a sequence never read is refused too."""
    import random

    from supernet.dataset import SEQ_KEYS

    data = FeatureData(data_dir)
    shards = [load_file(str(data_dir / s["file"])) for s in data.shards]
    assert len(shards) > 1 and all(int(t["offsets"].numel()) > 2 for t in shards)  # several sequences per shard
    refs = []
    for t in shards:
        for s in range(t["offsets"].numel() - 1):
            a, b = int(t["offsets"][s]), int(t["offsets"][s + 1])
            refs.append((t, a, b, int(t["prompt_len"][s])))
    order = list(range(len(data)))
    random.Random(3).shuffle(order)
    for i in order:
        t, a, b, plen = refs[i]
        seq = data[i]
        for k in SEQ_KEYS:
            assert torch.equal(seq[k], t[k][a:b].to(seq[k].dtype)), k
        assert all(torch.equal(v, t[f"hidden.{h}"][a:b].float()) for h, v in seq["hidden"].items())
        assert int(seq["prompt_len"]) == plen
    from safetensors.torch import save_file

    bad = _copy_data(data_dir, tmp_path / "nan-last")
    shard = bad / data.shards[1]["file"]
    tensors = load_file(str(shard))
    key = next(k for k in tensors if k.startswith("hidden."))
    tensors[key][-1, 0] = float("nan")  # the shard's last sequence
    save_file(tensors, str(shard))
    with pytest.raises(UserError, match="non-finite"):
        FeatureData(bad)[data.shards[0]["sequences"]]  # the shard's first sequence, which is clean


def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(data_dir, tmp_path, monkeypatch):
    """One non-finite step is skipped; a second in a row stops training with a clear error, and the checkpoint
    on disk is the last finite one (never NaN weights)."""
    import supernet.train as train_mod

    train(_cfg(data_dir, tmp_path / "run", steps=3, ckpt_every=3))
    good = load_file(str(tmp_path / "run" / "checkpoint" / ckpt.MODEL))
    real = train_mod.subnet_losses

    def poisoned(model, seq, cfg, seed=0, negatives=None):
        loss, stats = real(model, seq, cfg, seed=seed, negatives=negatives)
        return loss * float("nan"), stats

    monkeypatch.setattr(train_mod, "subnet_losses", poisoned)
    with pytest.raises(UserError, match="diverged"):
        train(_cfg(data_dir, tmp_path / "run", steps=8, ckpt_every=1, resume=True))
    after = load_file(str(tmp_path / "run" / "checkpoint" / ckpt.MODEL))
    assert all(torch.equal(good[k], after[k]) for k in good)
    assert all(bool(torch.isfinite(v).all()) for v in after.values() if v.is_floating_point())


def test_a_one_network_space_runs_one_pass_per_step(data_dir, tmp_path):
    """Training an arch alone (largest = smallest = sample) logs and computes one pass per step, not three."""
    space = tmp_path / "one.yaml"
    space.write_text("fusion: [concat]\nfeature_layers: [[-1]]\ndepth: [1]\nheads: [2]\nffn: [64]\n"
                     "draft_vocab: [null]\nvisual_keep: [1.0]\ntree_depth: [1, 2]\ntop_k: [1, 2]\ntotal_tokens: [2, 4]\n")
    train(_cfg(data_dir, tmp_path / "run", space=str(space), steps=3, n_random=1, reorder_at=0, val_sequences=0))
    rows = _losses(tmp_path / "run")
    assert [(s, r) for s, r, _ in rows] == [("0", "largest"), ("1", "largest"), ("2", "largest")]


class _Clock:
    """A stand-in for supernet.train's `time`: 10 s pass at each step's draw of sequences (`tick`); at `kill_at`
    the run is killed there (KeyboardInterrupt)."""

    def __init__(self, kill_at: float | None = None):
        self.now, self.kill_at = 0.0, kill_at

    def perf_counter(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 10.0
        if self.kill_at is not None and self.now >= self.kill_at:
            raise KeyboardInterrupt


def test_a_time_budget_counts_across_a_kill_and_resume(data_dir, tmp_path, monkeypatch):
    """A time-budgeted run keeps its clock in the checkpoint: killed and resumed, it stops after the same
    training time and steps as a run never interrupted, with the same weights; the stopped checkpoint says
    that its budget is spent (the pipeline's supernet stage then reuses it instead of training on)."""
    import supernet.train as train_mod

    real_ids = train_mod.sequence_ids

    def run(out, clock, **kw):
        monkeypatch.setattr(train_mod, "time", clock)
        monkeypatch.setattr(train_mod, "sequence_ids", lambda *a, **k: clock.tick() or real_ids(*a, **k))
        train(_cfg(data_dir, out, steps=100, time_budget_s=55.0, ckpt_every=2, **kw))

    run(tmp_path / "straight", _Clock())
    clock = _Clock(kill_at=40.0)
    with pytest.raises(KeyboardInterrupt):  # killed inside step 3, after the checkpoint of step 2
        run(tmp_path / "split", clock)
    assert ckpt.read_state(tmp_path / "split" / "checkpoint")["step"] == 2
    clock.kill_at = None
    run(tmp_path / "split", clock, resume=True)
    states = [ckpt.read_state(tmp_path / r / "checkpoint") for r in ("straight", "split")]
    assert [(s["step"], s["elapsed_s"], s["budget_spent"]) for s in states] == [(6, 60.0, True)] * 2
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "split")
    a = load_file(str(tmp_path / "straight" / "checkpoint" / ckpt.MODEL))
    b = load_file(str(tmp_path / "split" / "checkpoint" / ckpt.MODEL))
    assert all(torch.equal(a[k], b[k]) for k in a)
