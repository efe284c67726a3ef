"""Layer-wise, error-compensating refinement of one converted attention (after the closed form).

The closed form (``compress_layer``) fits each attention to the source's second moments, one
layer at a time and blind to what the layers before it got wrong. Here the converted decoder
layer sees the hidden states the converted layers below it produce (``inputs``, x) and is fitted
to what the source layer outputs on the source's own hidden states (``targets``, y), so it also
absorbs the error it inherits: block-wise reconstruction as in post-training quantisation
(BRECQ, Li et al. 2021; GPTQ's sequential calibration, Frantar et al. 2022). Only the attention
weights move (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, their biases); the
latent rank, the rotary dims and so the cache stay as the plan made them.

Loss: the relative squared error of the layer's update, sum ||f(x) - y||^2 / sum ||y - x||^2
(1 means "as bad as leaving the residual stream as it came in"), with f

- ``attention``: the residual stream after the attention, x + attn(norm(x)); the target is the
  source's x_src + attn_src(norm(x_src)) (``attention_residual``). Cheap (the MLP never runs) and
  quadratic in ``o_proj``, which therefore has a closed-form optimum (``refit_o_proj``).
- ``block``: the decoder layer's output, MLP included; the target is the source layer's output.

Steps: first the least-squares refit of ``o_proj`` given the converted path's attention outputs
(``attention`` loss only; its ridge chosen by two-fold cross-validation over the calibration
sequences, and skipped when a fold holds fewer tokens than o_proj has inputs or no ridge beats the closed
form on held-out sequences: ``refit_moments.fold_check``), then Adam with
a cosine-decayed step size. Adam moves every element by about its step size per step, so each tensor's step size is ``lr`` times its RMS: a relative
change of the weights, the same for any model's weight scale. The loss is evaluated before and
after on the same calibration sequences and the best of the start, the refit and the Adam result
is kept: refinement never returns weights with a higher calibration loss than it was given.

How the constants were chosen (none is fitted to one model):
- the refit's loss before and after come from its own normal equations (one attention pass), and so
  does its held-out error, which picks the ridge from a log grid (``refit_moments.choose_ridge``);
- ``lr`` 1e-3 of each tensor's RMS per step: over a cosine schedule the weights move by at most
  about steps * lr / 2 of their scale, a few percent for tens of steps: a correction of the
  closed form's start, not training from it;
- ``epochs`` 0 by default (the refit only): Adam after the refit removed little more of the loss
  for much more time, and Adam alone, or on the block target, got less than the refit
  (bench/experiments/refine_variants.py; results in bench/results/refine_variants.md);
- the ``attention`` target by default: the refit needs it, and its block-output loss came out
  below what Adam on the block target itself reached (same bench); the perplexity of each
  choice is in bench/experiments/refine_layerwise.py's results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..arch.names import MLA_ATTN_PROJ
from ..choices import REFINE_FIXED_INPUTS, REFINE_INPUTS, REFINE_MODES
from .refit_moments import FoldMoments, choose_ridge, fold_check, loss_of, ridge_solve, sum_folds, with_one

__all__ = ["ATTENTION_PARAMS", "EXACT_LOSS", "REFINE_LOSSES", "REFINE_METHODS", "RefineSettings", "attention_output",
           "attention_residual", "exact_loss", "layer_loss", "refine_layer", "run_to_attention"]

REFINE_LOSSES = ("attention", "block")
ATTENTION_PARAMS = MLA_ATTN_PROJ  # what refinement may move (all by default)
# A start already at float32 rounding (the full-rank conversion reproduces the source to ~1e-13
# relative squared error) is left untouched: there is nothing to compensate, and a bit-exact
# conversion must stay bit-exact. Any real compression error is many orders above it.
EXACT_LOSS = 1e-10
_EVAL_BATCH = 8  # sequences per no-grad forward when the loss is measured (calibration.BATCH_SIZE)
# --refine layer: this module on the converted stream; --refine values: the joint value / o_proj
# refit from moments on the source stream (refine_values.py); values-per-head: the same head by head,
# then o_proj (refine_heads.py)
REFINE_METHODS = tuple(m for m in REFINE_MODES if m not in ("auto", "none"))


def exact_loss(dtype: torch.dtype) -> float:
    """The largest relative loss of a start that counts as exact when its inputs and targets were rounded
    to DTYPE (the work directory's ``STORE_DTYPE``): the rounding's own error, whose relative energy is at
    most the squared unit roundoff (a third of it on average), or ``EXACT_LOSS``, whichever is larger. A
    lossy start that close to its targets has nothing they could show a refit how to fix."""
    return max(EXACT_LOSS, (torch.finfo(dtype).eps / 2) ** 2)


@dataclass(frozen=True)
class RefineSettings:
    """How one layer is refined. Steps follow from the data: ``ceil(epochs * sequences / batch)``."""

    method: str = "layer"  # REFINE_METHODS
    # REFINE_INPUTS: the hidden states the refinement reads; auto becomes what METHOD reads by default
    # (choices.REFINE_INPUTS)
    inputs: str = "auto"
    # the share of the inherited error a converted-stream value refit fits to undo (options.refine_compensate)
    compensate: float = 0.5
    loss: str = "attention"  # REFINE_LOSSES
    sequences: int | None = None  # calibration sequences refined on and measured on (the first ones; None: all)
    # Adam passes over those sequences; 0: the o_proj refit only, which gets most of the gain at a
    # fraction of the cost (bench/experiments/refine_variants.py)
    epochs: float = 0.0
    batch: int = 4  # sequences per Adam step
    lr: float = 1e-3  # Adam step size per step, relative to each tensor's RMS
    refit_o_proj: bool = True  # closed-form least squares of o_proj first (attention loss only)
    params: tuple[str, ...] = ATTENTION_PARAMS  # which attention projections Adam moves

    def __post_init__(self):
        if self.method not in REFINE_METHODS:
            raise ValueError(f"refine method {self.method!r} is not one of {', '.join(REFINE_METHODS)}")
        if self.inputs not in REFINE_INPUTS:
            raise ValueError(f"refine inputs {self.inputs!r} is not one of {', '.join(REFINE_INPUTS)}")
        needs = REFINE_FIXED_INPUTS.get(self.method)
        if self.inputs == "auto":
            object.__setattr__(self, "inputs", needs or "converted")
        if needs not in (None, self.inputs):
            raise ValueError(f"refine method {self.method} reads the {needs} stream, not the {self.inputs} one")
        if not (isinstance(self.compensate, (int, float)) and 0 <= self.compensate <= 1):
            raise ValueError(f"refine compensate must be a share in [0, 1]; got {self.compensate!r}")
        if self.method != "layer" and self.epochs:
            raise ValueError(f"refine epochs (Adam steps) apply to --refine layer; --refine {self.method} is a "
                             "closed-form refit: drop --refine-epochs or use --refine layer")
        if self.loss not in REFINE_LOSSES:
            raise ValueError(f"refine loss {self.loss!r} is not one of {', '.join(REFINE_LOSSES)}")
        if self.refit_o_proj and self.loss != "attention":
            raise ValueError("the closed-form o_proj refit needs the attention loss (the block loss is not "
                             "quadratic in o_proj); set refit_o_proj=False or loss='attention'")
        for name, value in (("sequences", self.sequences), ("batch", self.batch)):
            if (value is not None or name == "batch") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"refine {name} must be an integer >= 1; got {value!r}")
        if not (isinstance(self.epochs, (int, float)) and 0 <= self.epochs <= 1000):
            raise ValueError(f"refine epochs must be a number in [0, 1000]; got {self.epochs!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"refine lr (a step relative to the weights' RMS) must be in (0, 1); got {self.lr!r}")
        unknown = [p for p in self.params if p not in ATTENTION_PARAMS]
        if unknown or not self.params:
            raise ValueError(f"refine params {list(self.params)!r}: each must be one of "
                             f"{', '.join(ATTENTION_PARAMS)} (at least one)")

    def steps(self, n_sequences: int) -> int:
        """Adam steps for N_SEQUENCES available inputs."""
        return math.ceil(self.epochs * self.used(n_sequences) / self.batch)

    def used(self, n_sequences: int) -> int:
        """How many of N_SEQUENCES available inputs are refined on."""
        return n_sequences if self.sequences is None else min(self.sequences, n_sequences)


class _Stop(Exception):
    """Raised at the attention: the rest of the block is not needed."""


def run_to_attention(block: nn.Module, run: Callable, hidden: torch.Tensor, grab: Callable, before: bool = False):
    """RUN(block, HIDDEN) up to BLOCK's attention and no further (the MLP is never run); RUN supplies
    the mask and rotary table. Returns GRAB(attention, args, output) of the attention's call, or with
    BEFORE, GRAB(attention, args) on its inputs without running it."""
    seen = {}

    def hook(*call):
        seen["value"] = grab(*call)
        raise _Stop

    attn = block.self_attn
    handle = attn.register_forward_pre_hook(hook) if before else attn.register_forward_hook(hook)
    try:
        run(block, hidden)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["value"]


def _attention_value(out):
    """The output tensor of a self-attention call (modules return (output, ...) or the output)."""
    return out[0] if isinstance(out, tuple) else out


def keep_attention_output(block: nn.Module, seen: dict, heads: bool = False):
    """A forward hook on BLOCK's attention that keeps the output of its latest call in SEEN["attention"]
    (with HEADS, the input of its o_proj: every head's own output, (B, T, H d)); returns the hook's handle
    (the caller removes it)."""
    if heads:
        return block.self_attn.o_proj.register_forward_pre_hook(lambda o, args: seen.update(attention=args[0]))
    return block.self_attn.register_forward_hook(lambda attn, args, out: seen.update(attention=_attention_value(out)))


def attention_output(block: nn.Module, run: Callable, hidden: torch.Tensor, heads: bool = False) -> torch.Tensor:
    """What BLOCK's attention adds to the residual stream, self_attn(norm(hidden)), through
    RUN(block, hidden); with HEADS, its o_proj's input instead. Works for the source's decoder layers and
    the converted ones alike (both return (output, ...) from ``self_attn`` and add it to their input)."""
    if heads:
        seen = {}
        handle = keep_attention_output(block, seen, heads=True)
        try:
            run_to_attention(block, run, hidden, lambda attn, args, out: None)
        finally:
            handle.remove()
        return seen["attention"]
    return run_to_attention(block, run, hidden, lambda attn, args, out: _attention_value(out))


def attention_and_output(block: nn.Module, run: Callable, hidden: torch.Tensor,
                         heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOCK's attention output (as ``attention_output``, HEADS too) and the block's whole output, from one run."""
    seen = {}
    handle = keep_attention_output(block, seen, heads)
    try:
        out = run(block, hidden)
    finally:
        handle.remove()
    return seen["attention"], out


def attention_residual(block: nn.Module, run: Callable, hidden: torch.Tensor) -> torch.Tensor:
    """The residual stream after BLOCK's attention, hidden + self_attn(norm(hidden))."""
    return hidden + attention_output(block, run, hidden)


def _predict(block, run, hidden, loss: str) -> torch.Tensor:
    return attention_residual(block, run, hidden) if loss == "attention" else run(block, hidden)


@torch.no_grad()
def layer_loss(block, run, inputs: torch.Tensor, targets: torch.Tensor, loss: str) -> float:
    """sum ||f(x) - y||^2 / sum ||y - x||^2 over INPUTS / TARGETS (N, T, D), in float64."""
    err = ref = 0.0
    for s in range(0, inputs.shape[0], _EVAL_BATCH):
        x, y = inputs[s : s + _EVAL_BATCH], targets[s : s + _EVAL_BATCH]
        err += float((_predict(block, run, x, loss) - y).double().square().sum())
        ref += float((y - x).double().square().sum())
    return err / ref if ref > 0 else err


def _parameters(block, names: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
    attn = block.self_attn
    return [(f"{m}.{kind}", p) for m in names for kind, p in getattr(attn, m).named_parameters(recurse=False)]


@torch.no_grad()
def _o_proj_moments(block, run, inputs, targets):
    """One pass of the attention over INPUTS: per fold (even and odd sequences) Z^T Z, Z^T R and
    sum ||R||^2 (float64), with z the attention's output before o_proj ([z; 1] when o_proj has a
    bias) and r = y - x the update the attention should add. The attention loss is quadratic in
    W = [W_o | b], so these moments give the loss of any o_proj exactly, on either fold or both,
    with no further pass (refit_moments.quadratic_error). Returns the ``FoldMoments``, which also count
    each fold's tokens."""
    o = block.self_attn.o_proj
    seen = {}
    handle = o.register_forward_pre_hook(lambda module, args: seen.__setitem__("z", args[0]))
    moments = FoldMoments()
    try:
        for s in range(0, inputs.shape[0], _EVAL_BATCH):
            x, y = inputs[s : s + _EVAL_BATCH], targets[s : s + _EVAL_BATCH]
            attention_residual(block, run, x)
            moments.add(with_one(seen["z"].double(), o.bias is not None), y - x, s)
    finally:
        handle.remove()
    return moments


def _o_proj_matrix(o) -> torch.Tensor:
    w = o.weight.detach().double()
    return torch.cat([w, o.bias.detach().double()[:, None]], dim=1) if o.bias is not None else w


def _adam(block, run, inputs, targets, settings: RefineSettings, steps: int, seed: int, progress) -> None:
    params = _parameters(block, settings.params)
    # one step size per tensor: lr times the RMS of its module's weight (biases share it, since a
    # bias may start at zero)
    scale = {m: float(getattr(block.self_attn, m).weight.detach().double().square().mean().sqrt()) for m in settings.params}
    groups = [{"params": [p], "lr": settings.lr * (scale[name.split(".")[0]] or 1.0)} for name, p in params]
    opt = torch.optim.Adam(groups)
    base = [g["lr"] for g in groups]
    n = inputs.shape[0]
    ref = (targets - inputs).double().square().sum(dim=(1, 2))  # per-sequence normaliser
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    ticks = range(steps) if progress is None else progress(range(steps))
    with torch.enable_grad():
        for step in ticks:
            if order.numel() < settings.batch:
                order = torch.cat([order, torch.randperm(n, generator=gen)])
            pick, order = order[: settings.batch], order[settings.batch :]
            x, y = inputs[pick], targets[pick]
            err = (_predict(block, run, x, settings.loss) - y).square().sum()
            loss = err / ref[pick].sum().clamp_min(1e-30).to(err.dtype)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for g, lr in zip(opt.param_groups, base):  # cosine decay to zero over the run
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            opt.step()


def _own_attention_weights(block) -> None:
    """Give the attention private copies of its weights. ``load_state_dict(assign=True)`` (how
    ``MLALayers.layer`` attaches them) keeps the caller's tensors, and a float32 source's o_proj
    reaches the converted layer uncopied: writing in place would change the source itself."""
    for m in ATTENTION_PARAMS:
        module = getattr(block.self_attn, m)
        for kind, p in list(module.named_parameters(recurse=False)):
            setattr(module, kind, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def refine_layer(block: nn.Module, run: Callable, inputs: torch.Tensor, targets: torch.Tensor,
                 settings: RefineSettings, seed: int = 0, progress=None, exact: float = EXACT_LOSS) -> dict:
    """Refine BLOCK's attention in place so that f(inputs) comes closer to TARGETS (module docstring).

    BLOCK: a converted decoder layer (``MLALayers.layer``), float32. RUN(block, hidden): its
    forward in the caller's grad mode (``MLALayers.forward``). INPUTS (N, T, D): the hidden
    states entering the layer on the converted path; TARGETS (N, T, D): the source's, for
    ``settings.loss`` (``attention``: ``attention_residual`` of the source layer on the source
    path; ``block``: the source layer's output). The first ``settings.sequences`` are used.
    PROGRESS (optional) wraps the step range (a progress bar). EXACT: the start loss at or below which
    the start is kept (``exact_loss``). Returns the report: loss_before, loss_after, which result was
    kept, steps, seconds."""
    if inputs.shape != targets.shape or inputs.dim() != 3:
        raise ValueError(f"refine_layer needs inputs and targets of one shape (N, T, D); got "
                         f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
    start = time.time()
    n = settings.used(inputs.shape[0])
    inputs, targets = inputs[:n].detach(), targets[:n].detach()
    report = {"settings": asdict(settings) | {"params": list(settings.params)}, "sequences": n}
    _own_attention_weights(block)
    frozen = [(p, p.requires_grad) for p in block.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    try:
        attn = block.self_attn
        if settings.refit_o_proj:  # one pass gives the loss before and after the refit (exactly)
            accumulated = _o_proj_moments(block, run, inputs, targets)
            folds = accumulated.result()
            moments = sum_folds(folds)
            before = loss_of(_o_proj_matrix(attn.o_proj), *moments)
        else:
            before = layer_loss(block, run, inputs, targets, settings.loss)
        report["loss_before"] = before
        if before <= exact:
            return report | {"loss_after": before, "kept": "start (already exact)", "steps": 0,
                             "seconds": round(time.time() - start, 3)}
        best = (before, "start", {k: v.detach().clone() for k, v in attn.state_dict().items()})
        if settings.refit_o_proj:
            if why := fold_check(accumulated.rows, moments[0].shape[0]):
                report["refit"] = why
            else:
                ridge, validation = choose_ridge(_o_proj_matrix(attn.o_proj), folds,
                                                 lambda f, ridge: ridge_solve(*folds[f][:2], ridge))
                report |= validation
                if ridge is None:
                    report["refit"] = "skipped: no ridge beat the closed form on held-out sequences"
                else:
                    w = ridge_solve(moments[0], moments[1], ridge)
                    refit = loss_of(w, *moments)
                    report["loss_after_refit"] = refit
                    if refit < best[0]:
                        o = attn.o_proj
                        o.weight.copy_(w[:, : o.in_features].to(o.weight.dtype))
                        if o.bias is not None:
                            o.bias.copy_(w[:, -1].to(o.bias.dtype))
                        best = (loss_of(_o_proj_matrix(o), *moments), "o_proj refit",
                                {k: v.detach().clone() for k, v in attn.state_dict().items()})
            del accumulated, folds, moments  # done with before Adam, whether or not the refit ran
        steps = settings.steps(n)
        if steps:
            for _, p in _parameters(block, settings.params):
                p.requires_grad_(True)
            _adam(block, run, inputs, targets, settings, steps, seed, progress)
            for p, _ in frozen:
                p.requires_grad_(False)
            after = layer_loss(block, run, inputs, targets, settings.loss)
            report["loss_after_adam"] = after
            if after < best[0]:
                best = (after, "adam", None)
        if best[2] is not None:
            attn.load_state_dict(best[2])
        return report | {"loss_after": best[0], "kept": best[1], "steps": steps,
                         "seconds": round(time.time() - start, 3)}
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
