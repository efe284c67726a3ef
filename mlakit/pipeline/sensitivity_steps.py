"""The loss-sensitivity sweep of the layer driver (``driver.LayerDriver`` inherits it).

Fisher allocation needs each layer's loss sensitivity: the statistics pass keeps every layer's input for the
first calibration sequences (``calibration.sensitivity_sequences``), and this sweep, from the last layer to the
first, recomputes one layer at a time from its kept input and carries the gradient down, with labels sampled
from the source's own prediction (as ``calibration.collect_stats`` draws them in one whole-model backward pass).

The same gradients judge ``--rope-dim measured-per-layer``'s candidates. An error e_t that a converted layer's
attention adds to the residual stream at token t raises the expected KL of the model's next-token distribution,
to second order, by e_t^T F_t e_t / 2, where F_t = E[g_t g_t^T] is the Fisher of that distribution with respect
to the stream there, g_t the gradient of -log p(y_t) with respect to the attention's output for y_t drawn from
the model's own prediction: the gradient this sweep already computes. So sum_t (g_t . e_t)^2 over the swept
tokens estimates what the error costs the model's output through every layer above it (linearised), where the
error's size alone says nothing of where it points. The statistics pass keeps each candidate's held-out error
vectors on these sequences (``fold_steps.weighed_errors``); the sweep weighs them, per validation fold
(sequence k: fold k % 2), into the run state's ``measured`` records as ``weighed``: per token, and so about
twice the linearised KL per token the layer's error adds.
"""

from __future__ import annotations

import torch

from ..convert.calibration import logit_gradient
from .fold_steps import weighed_errors

__all__ = ["SensitivitySteps"]


class SensitivitySteps:
    """The sweep of ``LayerDriver`` (it reads the driver's setup ``c``, ``work``, ``state`` and ``src_layers``, and
    its ``_read_layer``, ``_accumulator``, ``_progress``, ``_commit`` and ``_weighed_rows``)."""

    def sensitivity_sweep(self) -> None:
        """Fisher allocation (and measured-per-layer rope dims): each layer's loss sensitivity, from the last layer
        down. Each layer is rebuilt from its tensors and run with gradients on its kept input (one sequence at a
        time); the last layer's output goes through the final norm and the LM head with labels sampled from the
        source's own prediction, as ``calibration.collect_stats`` draws them. Where the statistics pass kept the
        candidates' errors on these sequences, each is weighed by the gradient at the layer's attention output."""
        c, runner = self.c, self.src_layers
        head = runner.head(c.norm_and_head(), "head")
        generator = torch.Generator().manual_seed(c.opts.seed)
        sensitivity, grads = [None] * c.n, None
        weighed = self._weighed_rows()
        with self._progress("loss sensitivities", 0) as bar:
            for i in reversed(range(c.n)):
                layer = runner.layer(i, self._read_layer(i)).requires_grad_(False)
                probe = self._accumulator(layer)
                seen = []  # the gradient at the attention's output, per sequence
                handles = [layer.self_attn.register_forward_hook(probe.probe_gradient)]
                if weighed:
                    handles.append(layer.self_attn.register_forward_hook(_keep_gradient(seen)))
                try:
                    kept = self.work.load_tensors(f"sens-{i:05d}.pt")["hidden"].to(c.device, torch.float32)
                    below = []
                    for s in range(kept.shape[0]):
                        x = kept[s : s + 1].requires_grad_()
                        with torch.enable_grad():
                            out = runner.forward(layer, x)
                            out.backward(logit_gradient(head, out, generator) if grads is None else grads[s])
                        below.append(x.grad)
                finally:
                    for handle in handles:
                        handle.remove()
                if weighed:
                    self._weigh(i, [g.detach() for g in seen[:weighed]])
                grads, sensitivity[i] = below, probe.sensitivity()
                del layer, kept
                bar.update()
        self.state["sensitivity"] = sensitivity
        self._commit(None)
        if weighed:  # the sweep is committed: a resumed run does not read them again
            for i in range(c.n):
                (self.work.path / weighed_errors(i)).unlink(missing_ok=True)

    def _weigh(self, i: int, grads: list[torch.Tensor]) -> None:
        """Layer I's candidates' kept error vectors weighed by GRADS (1, T, D per sequence): sum_t (g_t . e_t)^2
        per validation fold over its tokens, into ``measured[i][d]["weighed"]``."""
        errors = self.work.load_tensors(weighed_errors(i))
        tokens = [sum(g.shape[1] for g in grads[k::2]) for k in (0, 1)]
        for d, e in errors.items():
            folds = [0.0, 0.0]
            for k, g in enumerate(grads):
                e_k = e[k].to(g.device, torch.float64)
                folds[k % 2] += float((g[0].double() * e_k).sum(-1).square().sum())
            self.state["measured"][str(i)][d]["weighed"] = [f / t for f, t in zip(folds, tokens) if t]


def _keep_gradient(seen: list):
    """A forward hook that appends the gradient at the module's output to SEEN in the backward pass."""

    def hook(module, args, out) -> None:
        (out[0] if isinstance(out, tuple) else out).register_hook(seen.append)

    return hook
