"""What splitting the loss chain buys on a Hugging Face Llama (issue 40):
``python -m benchmarks.bench_split``.

Three steps of the same model (HF ``LlamaForCausalLM``, random weights,
AdamW), each planned by memplan:

- ``unsplit``: the step as captured, its loss Hugging Face's (the logits
  upcast to float32 for the whole sequence);
- ``chunked-ce``: the loss written as torchtune's ``CEWithChunkedOutputLoss``
  computes it (the final hidden states cut into 8 chunks along the
  sequence, each chunk's logits made, upcast and summed into the loss,
  divided by the number of counted tokens), captured unsplit: what a user
  gets by changing the model's loss by hand;
- ``split``: the first step captured with ``split="auto"`` (or
  ``--chunks K``), memplan's own splitting.

With ``--fit SHARE`` (e.g. 0.001), two more: ``fitted``, the unsplit step
fitted with ``fit(max_added=SHARE, minimise="flops")`` (recomputation
alone), and ``split-fitted``, the split step fitted the same way, which
leaves it what the split left of that share, so both add at most SHARE
of the unsplit step's FLOPs (splitting and recomputation chosen
together, as issue 40 asks).

With ``--meta`` the model is on the meta device (nothing runs: Llama 3.2
1B's shape at seq 4096 plans on a laptop); without it, each side also
runs two real steps on the CPU, measured from the allocator's events
(:func:`memplan.torch._run.allocator_peak`): eager with the chunked loss
against memplan's split step, and the losses of the three are compared.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict


def _model(args):
    import torch
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, tie_word_embeddings=args.tied,
                        max_position_embeddings=max(args.seq, 128))
    if args.meta:
        with torch.device("meta"):
            return T.LlamaForCausalLM(cfg)
    return T.LlamaForCausalLM(cfg)


def _autocast(args):
    """bf16 autocast on the model's device (``args.device``, CPU unless
    set) with ``--bf16``."""
    import contextlib

    import torch

    device = getattr(args, "device", "cpu")
    return torch.autocast(device, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()


def hf_loss(args):
    def loss(m, b):
        with _autocast(args):
            return m(input_ids=b, labels=b).loss
    return loss


def chunked_ce_loss(args, chunks: int = 8):
    """torchtune's ``CEWithChunkedOutputLoss`` over the model's final
    hidden states: per chunk of the sequence, the chunk's logits (upcast to
    float32) and their summed cross-entropy; the sum over the counted
    tokens."""
    import torch.nn.functional as F

    def loss(m, b):
        with _autocast(args):
            h = m.model(input_ids=b).last_hidden_state
            labels = F.pad(b, (0, 1), value=-100)[..., 1:]
            total = 0.0
            for hc, lc in zip(h.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
                logits = m.lm_head(hc).float()
                total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lc.reshape(-1),
                                                reduction="sum", ignore_index=-100)
            return total / (labels != -100).sum()
    return loss


def run(args) -> Dict[str, Any]:
    import torch

    import memplan.torch as mt
    from memplan.torch._run import allocator_peak

    out: Dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2)]
    split = "auto" if args.chunks is None else args.chunks
    sides = [("unsplit", hf_loss(args), None, False), ("chunked-ce", chunked_ce_loss(args), None, False),
             ("split", hf_loss(args), split, False)]
    fit_share = getattr(args, "fit", None)
    if fit_share is not None:
        sides += [("fitted", hf_loss(args), None, True), ("split-fitted", hf_loss(args), split, True)]
    step_flops = None  # the unsplit step's
    for name, loss_fn, how, fit in sides:
        model = _model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        step = mt.capture(model, opt, batches[0], loss_fn, time_limit=args.time_limit, split=how)
        if step_flops is None:
            step_flops = sum(op.get("flops", 0) for op in step.graph["ops"])
        added = step.split["added_flops"] if step.split is not None else 0
        if fit:
            # On the split step, the share counts the split's FLOPs (Step.fit).
            fitted = step.fit(max_added=fit_share, minimise="flops", time_limit=args.time_limit)
            added += fitted["added_flops"]
        st = step.plan["stats"]
        row = {"seconds": time.perf_counter() - t0, "ops": len(step.graph["ops"]),
               "arena_bytes": step.plan["arena_bytes"], "max_live_bytes": st["max_live_bytes"],
               "lower_bound_bytes": st["lower_bound_bytes"], "added_flops": added,
               "added_share": added / step_flops}
        if step.split is not None:
            row["split"] = {k: step.split[k] for k in ("chunks", "tried", "added_flops")}
            row["split"]["step_flops"] = sum(op.get("flops", 0) for op in step.graph["ops"])
        if step.fitted is not None:
            row["recomputed_ops"] = len(step.fitted["recomputed_ops"])
        if not args.meta:
            losses = [float(step(batches[0]))]
            resident = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
            row["allocator_peak_bytes"] = allocator_peak(lambda: losses.append(float(step(batches[1]))), resident)
            row["losses"] = losses
            if name == "chunked-ce":
                eager = _model(args)
                eopt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
                eager_losses = []

                def eager_step(b):
                    loss = loss_fn(eager, b)
                    loss.backward()
                    eopt.step()
                    eopt.zero_grad(set_to_none=True)
                    eager_losses.append(float(loss))
                eager_step(batches[0])
                resident = list(eager.parameters()) + [v for s in eopt.state.values() for v in s.values()]
                out["eager-chunked-ce"] = {"allocator_peak_bytes": allocator_peak(lambda: eager_step(batches[1]),
                                                                                  resident),
                                           "losses": eager_losses}
        out[name] = row
    u, s, c = out["unsplit"]["arena_bytes"], out["split"]["arena_bytes"], out["chunked-ce"]["arena_bytes"]
    out["summary"] = {"split_below_unsplit": 1 - s / u, "split_below_chunked_ce": 1 - s / c}
    if fit_share is not None:
        f, sf = out["fitted"]["arena_bytes"], out["split-fitted"]["arena_bytes"]
        out["summary"].update(split_fitted_below_unsplit=1 - sf / u, split_fitted_below_fitted=1 - sf / f,
                              fitted_below_unsplit=1 - f / u)
    if not args.meta:
        e = out["eager-chunked-ce"]["allocator_peak_bytes"]
        out["summary"]["split_measured_below_eager_chunked_ce"] = 1 - out["split"]["allocator_peak_bytes"] / e
    return out


def model_arguments(p: argparse.ArgumentParser, *, layers: int, hidden: int, intermediate: int, heads: int,
                    kv_heads: int, vocab: int, seq: int, batch: int, time_limit: float) -> None:
    """The model, batch and split options both split benches take (this
    one and :mod:`benchmarks.bench_split_device`), with their defaults."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--tied", action="store_true", help="tie the embeddings to the LM head (Llama 3.2 1B does)")
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around the loss function")
    p.add_argument("--chunks", type=int, default=None, help="memplan's split into this many chunks (default: auto)")
    p.add_argument("--time-limit", type=float, default=time_limit)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--meta", action="store_true", help="the model on the meta device: plan only, nothing runs")
    model_arguments(p, layers=2, hidden=256, intermediate=1024, heads=4, kv_heads=2, vocab=32000, seq=256, batch=2,
                    time_limit=20.0)
    p.add_argument("--fit", metavar="SHARE", type=float, default=None,
                   help="also fit the unsplit and the split step at most SHARE of the step's FLOPs above it (0.001)")
    args = p.parse_args(argv)
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
