"""A real use of fa4_final: a small GPT trained on a synthetic task with it and with PyTorch's
SDPA (chapter 13). The run that stores it is measure/package_training.py:

    python -m measure.package_training                  # H100/H200: about a minute
    python -m measure.package_training --compile        # the same through torch.compile

The model is plain PyTorch (pre-norm blocks, GQA attention, GELU MLP) and its attention is one
function, swapped between runs: ``fa4_final.flash_attn_func`` or ``F.scaled_dot_product_attention``
(its flash, memory-efficient or math kernel). The task: read 64 random tokens and a separator,
then write them reversed; the loss counts only the reversed half, so it starts at ln(vocab) and
falls only by learning to attend (causally) to the right earlier position. Every run starts from
the same weights and sees the same batches.

Note [How close two loss curves must be]
Training amplifies every rounding difference: two correct bf16 attention kernels, which differ by
about 2e-3 relative per call (ANCHORS: SDPA flash, cuDNN, FA4 all at 2.3e-3), give loss curves
that drift apart as the weights do. How far they drift on this task is measured in the same run:
SDPA's memory-efficient kernel against SDPA's flash kernel. fa4_final must stay within twice that
drift, plus 0.05 nats (1.5% of ln 32, for when the two SDPA kernels happen to agree closely), at
every point of the curves smoothed over ``window`` steps. Step 0 (same weights, same batch, no
update yet) differs only by one forward's rounding and must agree within 0.01. A kernel that
leaks future keys (a broken causal mask) learns the task almost at once and a wrong gradient
slows learning: both leave that band.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

STEP0_TOL = 0.01
GAP_ATOL = 0.05


@dataclass(frozen=True)
class TrainConfig:
    vocab: int = 32  # token 0 unused, 1 the separator, 2.. the data
    half_len: int = 64  # tokens to reverse: sequences of 2 * half_len inputs
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4  # head dim d_model / n_heads = 64
    kv_heads: int = 2  # GQA: two query heads per k/v head
    batch: int = 64
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 0
    window: int = 25  # steps per point of the smoothed curves

    @property
    def seqlen(self) -> int:
        return 2 * self.half_len


# A CPU smoke test (a few seconds a run): learns the task to below half of ln(30) in 30 steps.
SMALL = TrainConfig(half_len=8, d_model=128, n_layers=1, n_heads=2, kv_heads=1, batch=8,
                    steps=30, lr=3e-3, warmup=5, window=5)


# ----------------------------------------------------------------------------------------------
# data


def reverse_batch(g: torch.Generator, cfg: TrainConfig, device="cpu"):
    """(inputs, targets), each (batch, 2 * half_len); targets are -100 where not scored."""
    x = torch.randint(2, cfg.vocab, (cfg.batch, cfg.half_len), generator=g)
    sep = torch.ones(cfg.batch, 1, dtype=x.dtype)
    seq = torch.cat([x, sep, x.flip(1)], dim=1)  # (batch, 2 * half_len + 1)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :cfg.half_len] = -100  # predicting the random half is impossible: not scored
    return inputs.to(device), targets.to(device)


# ----------------------------------------------------------------------------------------------
# attention implementations: (q, k, v) in (batch, seqlen, heads, dim) -> out like q, causal


def fa4_attention(q, k, v):
    from fa4_final import flash_attn_func

    return flash_attn_func(q, k, v, causal=True)[0]


def sdpa_attention(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def attention(q, k, v):
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    return attention


IMPLS = {
    "fa4_final": fa4_attention,
    "sdpa_flash": sdpa_attention("FLASH_ATTENTION"),
    "sdpa_efficient": sdpa_attention("EFFICIENT_ATTENTION"),
    "sdpa_math": sdpa_attention("MATH"),
}


# ----------------------------------------------------------------------------------------------
# the model


class Attention(nn.Module):
    def __init__(self, cfg: TrainConfig, attend):
        super().__init__()
        self.h, self.hk = cfg.n_heads, cfg.kv_heads
        self.hd = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, (self.h + 2 * self.hk) * self.hd, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.attend = attend

    def forward(self, x):
        b, s, _ = x.shape
        # views of one projection: last dim contiguous, other strides 16-byte multiples, so
        # TMA reads them without a copy
        q, k, v = self.qkv(x).split([self.h * self.hd, self.hk * self.hd, self.hk * self.hd],
                                    dim=-1)
        q = q.unflatten(-1, (self.h, self.hd))
        k, v = (t.unflatten(-1, (self.hk, self.hd)) for t in (k, v))
        return self.proj(self.attend(q, k, v).flatten(-2))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, attend):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, attend)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: TrainConfig, attend):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seqlen, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_of(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


# ----------------------------------------------------------------------------------------------
# training


def train(impl: str, cfg: TrainConfig, device="cuda", compile: bool = False) -> dict:
    """Train from seed ``cfg.seed`` with attention ``impl``; returns the loss of every step and
    the time of every step (ms, CUDA events; None on a CPU)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, IMPLS[impl]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    step_fn = loss_of
    if compile:
        step_fn = torch.compile(loss_of, fullgraph=True)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    cuda = torch.device(device).type == "cuda"
    losses, times = [], []
    for _ in range(cfg.steps):
        inputs, targets = reverse_batch(g, cfg, device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = step_fn(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if cuda:
            end.record()
            times.append((start, end))
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    return {"impl": impl, "compile": compile, "losses": [float(x) for x in losses],
            "step_ms": [s.elapsed_time(e) for s, e in times] if cuda else None}


def smooth(losses: list[float], window: int) -> list[float]:
    """Means of consecutive blocks of ``window`` steps."""
    return [statistics.fmean(losses[i:i + window]) for i in range(0, len(losses), window)]


def max_gap(a: list[float], b: list[float], window: int) -> float:
    return max(abs(x - y) for x, y in zip(smooth(a, window), smooth(b, window)))


def compare(runs: dict[str, dict], cfg: TrainConfig, candidate="fa4_final", baseline="sdpa_flash",
            yardstick="sdpa_efficient") -> dict:
    """Note [How close two loss curves must be], as numbers and a verdict."""
    a, b, y = (runs[n]["losses"] for n in (candidate, baseline, yardstick))
    drift = max_gap(y, b, cfg.window)
    gap = max_gap(a, b, cfg.window)
    allowed = 2 * drift + GAP_ATOL
    step0 = abs(a[0] - b[0])
    learned = {n: smooth(r["losses"], cfg.window)[-1] < 0.5 * math.log(cfg.vocab - 2)
               for n, r in runs.items()}
    return {"gap": gap, "drift": drift, "allowed": allowed, "step0_gap": step0,
            "ok": gap <= allowed and step0 <= STEP0_TOL and all(learned.values()),
            "learned": learned}


def step_ms(run: dict, skip: int = 10) -> float:
    """Median time of a training step after the first ``skip`` (compiles, allocations)."""
    return statistics.median(run["step_ms"][skip:])


def report(runs: dict[str, dict], cfg: TrainConfig, verdict: dict) -> str:
    tokens = cfg.batch * cfg.seqlen
    lines = [f"{'impl':16s} {'ms/step':>8s} {'tokens/s':>10s} {'loss@0':>8s} {'final':>8s} "
             f"{'gap vs sdpa_flash':>18s}"]
    for name, r in runs.items():
        ms = step_ms(r) if r["step_ms"] else float("nan")
        fin = smooth(r["losses"], cfg.window)[-1]
        gap = max_gap(r["losses"], runs["sdpa_flash"]["losses"], cfg.window)
        lines.append(f"{name:16s} {ms:8.2f} {tokens / ms * 1e3:10.3g} {r['losses'][0]:8.4f} "
                     f"{fin:8.4f} {gap:18.4f}")
    lines.append(f"fa4_final vs sdpa_flash: max gap {verdict['gap']:.4f} (allowed "
                 f"{verdict['allowed']:.4f} = 2 x the efficient-vs-flash drift "
                 f"{verdict['drift']:.4f} + {GAP_ATOL}); step 0 gap {verdict['step0_gap']:.2g} "
                 f"(<= {STEP0_TOL}); {'OK' if verdict['ok'] else 'FAIL'}")
    return "\n".join(lines)


def rows_of(runs: dict[str, dict], cfg: TrainConfig, verdict: dict) -> list[dict]:
    tokens = cfg.batch * cfg.seqlen
    knobs = {k: v for k, v in asdict(cfg).items()}
    rows = []
    for name, r in runs.items():
        ms = step_ms(r)
        base = {"impl": name, "compile": r["compile"], **knobs}
        rows += [base | {"metric": "step_ms", "value": ms, "unit": "ms"},
                 base | {"metric": "tokens_per_s", "value": tokens / ms * 1e3, "unit": "tok/s"},
                 base | {"metric": "final_loss", "value": smooth(r["losses"], cfg.window)[-1],
                         "unit": "nats", "losses": r["losses"]}]
    rows.append({"impl": "fa4_final", "metric": "max_loss_gap_vs_sdpa_flash",
                 "value": verdict["gap"], "unit": "nats", "allowed": verdict["allowed"],
                 "drift_efficient_vs_flash": verdict["drift"], "step0_gap": verdict["step0_gap"],
                 "ok": verdict["ok"], **knobs})
    return rows
